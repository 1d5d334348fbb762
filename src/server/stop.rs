//! Stop strings over streamed text: a piece is released only once no stop string can
//! start inside it, so a client never sees the beginning of a stop string that then
//! completes (OpenAI's `stop`: the reply ends before it, without it).

/// The text of one reply as it streams, checked against its stop strings.
pub struct StopText {
    stops: Vec<String>,
    /// Text received and not yet released.
    held: String,
    /// Set once a stop string was found: nothing more is released.
    done: bool,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopText {
            stops,
            held: String::new(),
            done: false,
        }
    }

    /// Adds `piece`; returns the text that can be released now and whether a stop string
    /// was found (the released text then ends just before it).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.done {
            return (String::new(), true);
        }
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), false);
        }
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.done = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len())
                    .rev()
                    .filter(|&n| s.is_char_boundary(n))
                    .find(|&n| self.held.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The text still held (the reply ended for another reason).
    pub fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::StopText;

    #[test]
    fn holds_back_a_possible_stop_and_cuts_before_it() {
        let mut s = StopText::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(s.push("hello E"), ("hello ".into(), false));
        assert_eq!(s.push("N"), (String::new(), false));
        assert_eq!(s.push("D and more"), (String::new(), true));
        let mut s = StopText::new(vec!["END".into()]);
        assert_eq!(s.push("hello E"), ("hello ".into(), false));
        assert_eq!(s.push("x"), ("Ex".into(), false));
        assert_eq!(s.push("tail E"), ("tail ".into(), false));
        assert_eq!(s.flush(), "E");
        let mut s = StopText::new(vec!["é!".into()]);
        assert_eq!(s.push("café"), ("caf".into(), false));
        assert_eq!(s.push("!"), (String::new(), true));
    }
}
