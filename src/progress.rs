//! Progress bars for long work (loading, uploading, long prompts): drawn on stderr only
//! when it is a terminal and the work is large enough to be worth watching.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over `total` units, hidden for small totals or when stderr is not a terminal.
pub fn bar(total: u64, message: &str) -> ProgressBar {
    const WORTH_SHOWING: u64 = 50_000_000;
    if total < WORTH_SHOWING {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{msg} [{bar:40}] {percent}% ({elapsed} / ~{duration})")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message.to_string());
    bar
}
