//! Perplexity of a text: the standard quality check for quantized weights. The tokens are
//! cut into consecutive windows of `ctx` tokens (a last shorter window is kept when it has
//! at least 2 tokens); each window runs from a fresh state and every position but its
//! first is predicted. The figure is exp(mean NLL) over all predicted positions — the
//! definition scripts/train_tiny.py uses for the embedded model's held-out figure.

use crate::error::{Error, Result};
use crate::session::Session;

/// The outcome of a perplexity run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// Mean negative log-likelihood (natural log) per predicted token.
    pub nll: f64,
    pub ppl: f64,
    pub predicted: usize,
    pub windows: usize,
}

/// −log softmax(logits)[target], computed in f64.
pub fn nll_of(logits: &[f32], target: u32) -> f64 {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    m + z.ln() - logits[target as usize] as f64
}

/// Runs `tokens` through `session` window by window (`on_window(done, total)` reports
/// progress).
pub fn perplexity(
    session: &mut Session,
    tokens: &[u32],
    ctx: usize,
    mut on_window: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    if ctx < 2 {
        return Err(Error::InvalidInput(format!(
            "--ctx must be at least 2, found {ctx}"
        )));
    }
    let windows: Vec<&[u32]> = tokens.chunks(ctx).filter(|w| w.len() >= 2).collect();
    if windows.is_empty() {
        return Err(Error::InvalidInput(
            "the text has fewer than 2 tokens".into(),
        ));
    }
    let (mut total, mut count) = (0.0, 0usize);
    for (i, w) in windows.iter().enumerate() {
        session.reset()?;
        let logits = session.logits(&w[..w.len() - 1])?;
        for (l, &t) in logits.iter().zip(&w[1..]) {
            total += nll_of(l, t);
            count += 1;
        }
        on_window(i + 1, windows.len());
    }
    let nll = total / count as f64;
    Ok(Perplexity {
        nll,
        ppl: nll.exp(),
        predicted: count,
        windows: windows.len(),
    })
}
