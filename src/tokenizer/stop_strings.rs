//! Stop strings (`"stop"` in the OpenAI API) over streamed text.
//!
//! A stop string can straddle two deltas, so text that could be the start of one is held back until
//! the next delta shows whether it is. The stop string itself is never emitted, as in the OpenAI API.

/// What one delta of text contributed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopScan {
    /// Text that is certainly output.
    pub text: String,
    /// A stop string was found: generation should end, and nothing after `text` is output.
    pub stopped: bool,
}

#[derive(Debug, Default)]
pub struct StopStringMatcher {
    stops: Vec<String>,
    /// Text held back because it is a prefix of some stop string.
    held: String,
    stopped: bool,
}

impl StopStringMatcher {
    /// Empty strings are ignored (they would match everywhere).
    pub fn new(stops: Vec<String>) -> Self {
        StopStringMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), stopped: false }
    }

    pub fn push(&mut self, delta: &str) -> StopScan {
        if self.stopped {
            return StopScan { text: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            return StopScan { text: delta.to_string(), stopped: false };
        }
        self.held.push_str(delta);
        if let Some(at) = self.stops.iter().filter_map(|stop| self.held.find(stop.as_str())).min() {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return StopScan { text, stopped: true };
        }
        let keep = self.longest_suffix_that_starts_a_stop();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopScan { text, stopped: false }
    }

    /// Generation ended: what was held back is output after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn longest_suffix_that_starts_a_stop(&self) -> usize {
        let held = self.held.as_str();
        held.char_indices()
            .map(|(start, _)| held.len() - start)
            .find(|&len| self.stops.iter().any(|stop| stop.starts_with(&held[held.len() - len..])))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut matcher = StopStringMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for delta in deltas {
            let scan = matcher.push(delta);
            out.push_str(&scan.text);
            if scan.stopped {
                return (out, true);
            }
        }
        out.push_str(&matcher.finish());
        (out, false)
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn stop_inside_one_delta_truncates_before_it() {
        assert_eq!(run(&["END"], &["hello END world"]), ("hello ".into(), true));
    }

    #[test]
    fn stop_split_over_deltas_is_found_and_never_emitted() {
        let mut matcher = StopStringMatcher::new(vec!["\n\n".into()]);
        assert_eq!(matcher.push("line\n"), StopScan { text: "line".into(), stopped: false });
        assert_eq!(matcher.push("\nmore"), StopScan { text: String::new(), stopped: true });
    }

    #[test]
    fn held_prefix_is_released_when_it_does_not_continue() {
        assert_eq!(run(&["STOP"], &["ST", "ART"]), ("START".into(), false));
        assert_eq!(run(&["STOP"], &["abc ST"]), ("abc ST".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["b", "a"], &["xxabyy"]), ("xx".into(), true));
    }

    #[test]
    fn multibyte_text_is_split_on_character_boundaries() {
        assert_eq!(run(&["é!"], &["café", "é", "?"]), ("caféé?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
