//! Drafts made but not offered: while the back-off offers an ngram row no drafts, what the
//! drafter would have drafted is checked against the tokens that come instead, so that the
//! back-off learns what drafts are worth without paying to verify them.
//!
//! A draft is accepted by verification exactly when it equals the token drawn at its position
//! (DESIGN Invariant 3: drafts never change the tokens), so the tokens that come are what the
//! drafts would have been checked against. Only the ngram drafter is shadowed: it is a search
//! in the request's own text, done on the host, while the MTP drafter costs a forward (which a
//! backed-off step skips).

use crate::engine::request::RequestId;
use std::collections::HashMap;

/// Drafts made for a request at a position (the index in its tokens of the first draft).
#[derive(Debug, Clone, Default)]
pub struct ShadowDrafts {
    pending: HashMap<RequestId, (usize, Vec<u32>)>,
}

impl ShadowDrafts {
    /// `drafts` would have been offered for the token at `position`; kept unless the request
    /// has drafts waiting for their tokens already.
    pub fn hold(&mut self, id: RequestId, position: usize, drafts: Vec<u32>) {
        if !drafts.is_empty() {
            self.pending.entry(id).or_insert((position, drafts));
        }
    }

    /// Once `tokens` (the request's tokens so far) reach past its held drafts: (drafts, how many
    /// of them in a row equal the tokens that came).
    pub fn settle(&mut self, id: RequestId, tokens: &[u32]) -> Option<(usize, usize)> {
        let (position, drafts) = self.pending.get(&id)?;
        if tokens.len() < position + drafts.len() {
            return None;
        }
        let accepted = drafts.iter().zip(&tokens[*position..]).take_while(|(d, t)| d == t).count();
        let drafted = drafts.len();
        self.pending.remove(&id);
        Some((drafted, accepted))
    }

    /// The request ended (or its drafts would not reach the tokens they were made for).
    pub fn forget(&mut self, id: RequestId) {
        self.pending.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_drafts_are_settled_against_the_tokens_that_came() {
        let mut s = ShadowDrafts::default();
        s.hold(7, 3, vec![10, 11, 12]);
        // A second hold while the first waits is ignored.
        s.hold(7, 4, vec![99]);
        assert_eq!(s.settle(7, &[0, 1, 2, 10, 11]), None);
        assert_eq!(s.settle(7, &[0, 1, 2, 10, 11, 13]), Some((3, 2)));
        assert_eq!(s.settle(7, &[0, 1, 2, 10, 11, 13]), None);
        s.hold(7, 6, vec![20, 21]);
        assert_eq!(s.settle(7, &[0, 1, 2, 10, 11, 13, 5, 21, 9]), Some((2, 0)));
        s.hold(8, 1, vec![1]);
        s.forget(8);
        assert_eq!(s.settle(8, &[0, 1]), None);
        // Nothing to hold.
        s.hold(9, 1, Vec::new());
        assert_eq!(s.settle(9, &[0, 1]), None);
    }
}
