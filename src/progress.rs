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

/// Tokens between reports while a long prompt is read (a few prefill blocks; a GPU reads
/// ~10 000 tokens a second on the big models, the CPU reference far fewer).
pub const PROMPT_STEP: usize = 8192;

/// A bar over a long prompt's tokens for `Session::set_prompt_progress` (prompts of two
/// steps or more, `PROMPT_STEP`), drawn on stderr when it is a terminal and cleared when
/// the prompt is read. Each prompt's first report (`fed == 0`) starts a new bar, so one
/// left by a read that failed midway is dropped.
pub fn prompt_progress() -> crate::session::PromptProgress {
    let mut bar: Option<ProgressBar> = None;
    crate::session::PromptProgress {
        every: PROMPT_STEP,
        on: Box::new(move |fed, total| {
            if fed == 0 {
                if let Some(old) = bar.take() {
                    old.finish_and_clear();
                }
                let b =
                    ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
                if let Ok(style) = ProgressStyle::with_template(
                    "reading the prompt [{bar:40}] {pos}/{len} tokens ({elapsed} / ~{duration})",
                ) {
                    b.set_style(style.progress_chars("=> "));
                }
                // Redrawn while a piece is read (the first may take minutes on a CPU).
                b.enable_steady_tick(std::time::Duration::from_millis(500));
                bar = Some(b);
            }
            if let Some(b) = &bar {
                b.set_position(fed as u64);
                if fed >= total {
                    b.finish_and_clear();
                    bar = None;
                }
            }
            true
        }),
    }
}
