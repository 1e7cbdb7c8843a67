//! Where a generation stands in a compiled grammar: the matcher, advanced on the thread pool
//! as tokens are committed, and the masks it gives.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use llguidance::Matcher;
use toktrie::SimpleVob;

/// A compiled grammar and where a generation stands in it.
///
/// Committing tokens hands the matcher to the global thread pool, which advances it and computes
/// the mask of the next position right away: the next step's first mask is ready (or on its way)
/// before that step's forward starts, and the engine thread only sends the tokens off. Whatever
/// reads the matcher next waits for that work first, so the masks are those of stepping in place.
///
/// Most of a mask's cost is building lexer states the first time the output reaches them, and
/// each clone (one per request) owns its lexer. So the clones of one compiled grammar share an
/// origin: a matcher at the start that holds the lexer states built so far. A clone at the start
/// begins from it, and a clone that ends gives its matcher, rolled back to the start, back to it:
/// the next requests with that grammar find the states its predecessors reached.
pub struct Grammar {
    slot: Mutex<Slot>,
    pub(super) origin: Arc<Mutex<Origin>>,
}

pub(super) struct Origin {
    matcher: Matcher,
    /// How many ended clones gave their lexer states back.
    pub(super) given_back: usize,
}

enum Slot {
    Ready(Box<GrammarState>),
    /// Committed tokens handed to the pool.
    Advancing(Arc<Advance>),
}

/// Committed tokens to consume, shared by a task on the pool and the grammar. The task does the
/// work if it starts first; the grammar, wanting its state back before the task has started (a
/// busy pool), does the work itself; otherwise it waits for the task.
struct Advance {
    stage: Mutex<Stage>,
    done: Condvar,
}

enum Stage {
    Queued(Box<GrammarState>, Vec<u32>),
    Running,
    Done(Box<GrammarState>),
    /// The work panicked (llguidance turns its own panics into an error state).
    Failed,
    Taken,
}

impl Advance {
    /// Nothing to do yet (or any more).
    fn taken() -> Arc<Advance> {
        Arc::new(Advance { stage: Mutex::new(Stage::Taken), done: Condvar::new() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Consumes the tokens, then computes the mask of the position after them.
    fn work(mut state: Box<GrammarState>, tokens: &[u32]) -> Box<GrammarState> {
        let started = Instant::now();
        state.commit(tokens);
        state.ahead = Some(state.mask_here(state.active));
        state.work += started.elapsed();
        state
    }

    /// The pool's task: the work, unless the grammar took it.
    fn run(&self) {
        let (state, tokens) = {
            let mut stage = self.lock();
            match std::mem::replace(&mut *stage, Stage::Running) {
                Stage::Queued(state, tokens) => (state, tokens),
                other => {
                    *stage = other;
                    return;
                }
            }
        };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Advance::work(state, &tokens)));
        *self.lock() = outcome.map_or(Stage::Failed, Stage::Done);
        self.done.notify_all();
    }

    /// The state, advanced; with `run_queued` false, work not started is dropped and the state
    /// comes back as it was. `None` if the work panicked.
    fn finish(&self, run_queued: bool) -> Option<Box<GrammarState>> {
        let mut stage = self.lock();
        loop {
            match std::mem::replace(&mut *stage, Stage::Taken) {
                Stage::Queued(state, tokens) => {
                    drop(stage);
                    return Some(if run_queued { Advance::work(state, &tokens) } else { state });
                }
                Stage::Done(state) => return Some(state),
                Stage::Running => {
                    *stage = Stage::Running;
                    stage = self.done.wait(stage).unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                Stage::Failed | Stage::Taken => return None,
            }
        }
    }
}

/// The matcher and the rules around it.
struct GrammarState {
    matcher: Matcher,
    /// The request's end tokens: allowed where the grammar may end.
    end_tokens: Vec<u32>,
    /// Every end token of the model: llguidance allows any of them where the grammar may end.
    all_end_tokens: Vec<u32>,
    /// The grammar applies from the token after this one on.
    starts_after: Option<u32>,
    active: bool,
    /// The mask at the current position, computed ahead after the last commit.
    ahead: Option<TokenMask>,
    /// Tokens the matcher has consumed (0: it stands at the start).
    consumed: usize,
    /// Time spent advancing the matcher and computing masks, not yet reported.
    work: Duration,
}

/// A clone owns its lexer state. llguidance's plain clone shares it behind one lock, so the
/// masks of requests cloned from one compiled grammar (a schema given to many requests) would
/// be computed one at a time however many threads compute them.
impl Clone for Grammar {
    fn clone(&self) -> Self {
        let mut slot = self.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let state = slot.ready();
        let matcher = match state.consumed {
            0 => self.origin.lock().unwrap_or_else(std::sync::PoisonError::into_inner).matcher.deep_clone(),
            _ => state.matcher.deep_clone(),
        };
        let copy = GrammarState {
            matcher,
            end_tokens: state.end_tokens.clone(),
            all_end_tokens: state.all_end_tokens.clone(),
            starts_after: state.starts_after,
            active: state.active,
            ahead: state.ahead.clone(),
            consumed: state.consumed,
            work: Duration::ZERO,
        };
        Grammar { slot: Mutex::new(Slot::Ready(Box::new(copy))), origin: self.origin.clone() }
    }
}

/// An ended clone gives its lexer states back to the origin, on the pool (the rollback walks
/// back over the generation).
impl Drop for Grammar {
    fn drop(&mut self) {
        // What is left in the slot is never read: the grammar is going.
        let slot = std::mem::replace(self.slot.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner), Slot::Advancing(Advance::taken()));
        let origin = self.origin.clone();
        rayon::spawn(move || {
            let mut state = match slot {
                Slot::Ready(state) => state,
                // A panic in the pool's work has nothing to give back.
                Slot::Advancing(advance) => match advance.finish(false) {
                    Some(state) => state,
                    None => return,
                },
            };
            if state.consumed > 0 && !state.matcher.is_error() && state.matcher.reset().is_ok() {
                let mut origin = origin.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                origin.matcher = state.matcher;
                origin.given_back += 1;
            }
        });
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").finish_non_exhaustive()
    }
}

/// The tokens allowed at one position; `None` where the grammar does not apply yet.
pub type TokenMask = Option<SimpleVob>;

impl Slot {
    /// The state, once the pool's work on it is done.
    fn ready(&mut self) -> &mut GrammarState {
        if let Slot::Advancing(advance) = self {
            *self = Slot::Ready(advanced(advance));
        }
        match self {
            Slot::Ready(state) => state,
            Slot::Advancing(_) => unreachable!("the slot was just made ready"),
        }
    }
}

/// The state with the committed tokens consumed; a panic in that work is carried to this
/// thread, as the masks' thread carries its own.
fn advanced(advance: &Advance) -> Box<GrammarState> {
    advance.finish(true).unwrap_or_else(|| panic!("advancing a grammar panicked on the thread pool"))
}

impl Grammar {
    /// A freshly compiled grammar at its start; `all_end_tokens` are the model's.
    pub(super) fn compiled(matcher: Matcher, end_tokens: Vec<u32>, all_end_tokens: Vec<u32>) -> Grammar {
        let mut state = GrammarState { matcher, end_tokens, all_end_tokens, starts_after: None, active: true, ahead: None, consumed: 0, work: Duration::ZERO };
        // The first mask, computed now, is copied into every clone; computing it also builds
        // the lexer states of the start, which the origin keeps.
        state.ahead = Some(state.mask_here(true));
        let origin = Arc::new(Mutex::new(Origin { matcher: state.matcher.deep_clone(), given_back: 0 }));
        Grammar { slot: Mutex::new(Slot::Ready(Box::new(state))), origin }
    }

    fn state(&mut self) -> &mut GrammarState {
        self.slot.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).ready()
    }

    /// The grammar applies only after `token` was generated.
    pub fn starting_after(mut self, token: u32) -> Self {
        let state = self.state();
        state.starts_after = Some(token);
        state.active = false;
        state.ahead = None;
        self
    }

    /// The masks of a verify row's positions: position `i` as if `drafts[..i]` were generated.
    /// Where a draft breaks the grammar the row's later positions cannot be reached (that draft
    /// is rejected), and their masks are left out. The first is the one computed ahead, if any.
    pub fn masks(&mut self, drafts: &[u32]) -> Vec<TokenMask> {
        let state = self.state();
        let started = Instant::now();
        let masks = state.masks(drafts);
        state.work += started.elapsed();
        masks
    }

    /// How many of `drafts` the grammar allows in a row (drafts past that are not worth
    /// verifying). An end token stops the count: nothing follows it.
    pub fn valid_drafts(&mut self, drafts: &[u32]) -> usize {
        self.state().valid_drafts(drafts)
    }

    /// Advances over tokens a step committed (a final end token is not consumed: it ends the
    /// generation), on the global thread pool, which then computes the next position's mask.
    pub fn commit(&mut self, tokens: &[u32]) {
        let advance = Advance::taken();
        let slot = self.slot.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let state = match std::mem::replace(slot, Slot::Advancing(advance.clone())) {
            Slot::Ready(state) => state,
            Slot::Advancing(previous) => advanced(&previous),
        };
        *advance.lock() = Stage::Queued(state, tokens.to_vec());
        rayon::spawn(move || advance.run());
    }

    /// The time spent on this grammar (on any thread) since the last call.
    pub fn take_work(&mut self) -> Duration {
        std::mem::take(&mut self.state().work)
    }
}

impl GrammarState {
    fn masks(&mut self, drafts: &[u32]) -> Vec<TokenMask> {
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        let mut active = self.active;
        let mut consumed = 0;
        let first = match self.ahead.take() {
            Some(mask) => mask,
            None => self.mask_here(active),
        };
        masks.push(first);
        for &draft in drafts {
            if active {
                // A token the grammar refuses is checked first: consuming it would break the matcher.
                if self.end_tokens.contains(&draft) || self.matcher.try_consume_tokens(&[draft]).unwrap_or(0) != 1 {
                    break;
                }
                consumed += 1;
            } else if Some(draft) == self.starts_after {
                active = true;
            }
            masks.push(self.mask_here(active));
        }
        if consumed > 0 && self.matcher.rollback(consumed).is_err() {
            debug_assert!(false, "rolling back {consumed} consumed drafts failed");
        }
        masks
    }

    fn valid_drafts(&mut self, drafts: &[u32]) -> usize {
        let start = if self.active {
            0
        } else {
            match drafts.iter().position(|&d| Some(d) == self.starts_after) {
                Some(at) => at + 1,
                None => return drafts.len(),
            }
        };
        let tail = &drafts[start..];
        let until_end = tail.iter().position(|t| self.end_tokens.contains(t)).unwrap_or(tail.len());
        let valid = self.matcher.validate_tokens(&tail[..until_end]).unwrap_or(0);
        // An end token where the grammar cannot end is rejected by its position's mask.
        start + valid + usize::from(valid == until_end && until_end < tail.len())
    }

    fn commit(&mut self, tokens: &[u32]) {
        self.ahead = None;
        for &token in tokens {
            if !self.active {
                self.active = Some(token) == self.starts_after;
            } else if !self.end_tokens.contains(&token) {
                // A token the mask allowed is always accepted. One it did not (the mask was
                // skipped) puts the matcher in its error state, whose mask lets the output end.
                let _ = self.matcher.consume_token(token);
                self.consumed += 1;
            }
        }
    }

    fn mask_here(&mut self, active: bool) -> TokenMask {
        if !active {
            return None;
        }
        let trie = match self.matcher.tok_env() {
            Ok(env) => env,
            Err(_) => return Some(self.end_only(None)),
        };
        match self.matcher.compute_mask_or_eos() {
            Ok(mut mask) => {
                // Where the output may end, the request's own end tokens end it.
                let may_end = self.all_end_tokens.iter().any(|&t| mask.is_allowed(t));
                for &t in &self.all_end_tokens {
                    mask.set(t as usize, false);
                }
                for &t in &self.end_tokens {
                    mask.set(t as usize, may_end);
                }
                Some(mask)
            }
            Err(_) => Some(self.end_only(Some(trie.tok_trie().vocab_size()))),
        }
    }

    /// A broken matcher lets the generation do nothing but end.
    fn end_only(&self, vocab: Option<usize>) -> SimpleVob {
        let size = vocab.unwrap_or_else(|| self.end_tokens.iter().max().map_or(1, |&t| t as usize + 1));
        let mut mask = SimpleVob::alloc(size);
        for &t in &self.end_tokens {
            mask.allow_token(t);
        }
        mask
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{allowed, setup, stepped_masks, SCHEMA};
    use super::super::GrammarSpec;
    use super::*;

    #[test]
    fn draft_masks_equal_step_masks_and_leave_the_state_unchanged() {
        let (tokenizer, compiler, end) = setup();
        let spec = GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema"));
        let tokens = tokenizer.encode(r#"{"a": 7, "b": "x"}"#, false).expect("encodes");
        let mut stepped = compiler.compile(&spec, &[end]).expect("compiles");
        let mut expected = Vec::new();
        for &token in &tokens {
            expected.push(stepped.masks(&[]).remove(0).expect("a mask").to_list());
            stepped.commit(&[token]);
        }
        let mut drafted = compiler.compile(&spec, &[end]).expect("compiles");
        let got: Vec<Vec<u32>> = drafted.masks(&tokens[..tokens.len() - 1]).into_iter().map(|m| m.expect("a mask").to_list()).collect();
        assert_eq!(got, expected);
        assert_eq!(drafted.masks(&[]).remove(0).expect("a mask").to_list(), expected[0], "rolled back to where it was");
        assert_eq!(drafted.valid_drafts(&tokens), tokens.len());
        // A draft the grammar refuses cuts the row: its position's mask is the last one.
        let mut bad = tokens.clone();
        bad[3] = tokenizer.encode("[", false).expect("encodes")[0];
        assert_eq!(drafted.valid_drafts(&bad), 3);
        assert_eq!(drafted.masks(&bad).len(), 4);
    }

    /// Clones (one per request of a shared schema) own their state: advanced on threads of
    /// their own, each gives the masks of the grammar stepped alone, and the original is untouched.

    #[test]
    fn clones_step_apart_on_threads_of_their_own() {
        let (tokenizer, compiler, end) = setup();
        let original = compiler.compile(&GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema")), &[end]).expect("compiles");
        let texts = [r#"{"a": 1, "b": "x"}"#, r#"{"a": 250, "b": "y"}"#, r#"{"a": -3, "b": "x"}"#, r#"{"a": 44, "b": "y"}"#];
        let expected: Vec<Vec<Vec<u32>>> = texts
            .iter()
            .map(|text| {
                let mut alone = compiler.compile(&GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema")), &[end]).expect("compiles");
                stepped_masks(&mut alone, &tokenizer, text)
            })
            .collect();
        let stepped: Vec<Vec<Vec<u32>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = texts
                .iter()
                .map(|text| {
                    let (mut clone, tokenizer) = (original.clone(), &tokenizer);
                    scope.spawn(move || stepped_masks(&mut clone, tokenizer, text))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        });
        assert_eq!(stepped, expected);
        let mut original = original;
        assert_eq!(original.masks(&[]).remove(0).expect("a mask").to_list(), expected[0][0], "the original still stands at the start");
    }

    /// A commit advances the matcher on the pool and computes the next mask there: that mask
    /// equals the one computed in place (with nothing ahead) and the one computed for the same
    /// position as a draft, and whatever reads the grammar while the commit is in flight (a
    /// clone, a draft check) sees the committed tokens.

    #[test]
    fn masks_computed_ahead_equal_masks_computed_in_step() {
        let (tokenizer, compiler, end) = setup();
        let spec = GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema"));
        let tokens = tokenizer.encode(r#"{"a": 305, "b": "y"}"#, false).expect("encodes");
        let mut drafted = compiler.compile(&spec, &[end]).expect("compiles");
        let as_drafts: Vec<Vec<u32>> = drafted.masks(&tokens).into_iter().map(|m| m.expect("a mask").to_list()).collect();
        assert_eq!(as_drafts.len(), tokens.len() + 1, "every token is allowed");
        let mut stepped = compiler.compile(&spec, &[end]).expect("compiles");
        let (mut at, sizes) = (0, [1usize, 2, 1, 3]);
        for k in 0.. {
            if at == tokens.len() {
                break;
            }
            let chunk = sizes[k % sizes.len()].min(tokens.len() - at);
            stepped.commit(&tokens[at..at + chunk]);
            at += chunk;
            if at % 2 == 0 {
                // Read while the commit may still be in flight.
                let mut clone = stepped.clone();
                assert_eq!(clone.masks(&[]).remove(0).expect("a mask").to_list(), as_drafts[at], "the clone at {at}");
                assert_eq!(stepped.valid_drafts(&tokens[at..]), tokens.len() - at);
            }
            assert!(stepped.state().ahead.is_some(), "the commit computed the next mask");
            let ahead = stepped.masks(&[]).remove(0).expect("a mask").to_list();
            assert!(stepped.state().ahead.is_none(), "the mask ahead is used once");
            let in_place = stepped.masks(&[]).remove(0).expect("a mask").to_list();
            assert_eq!(ahead, in_place, "at {at}");
            assert_eq!(ahead, as_drafts[at], "at {at}");
        }
        assert!(stepped.take_work() > Duration::ZERO && stepped.take_work() == Duration::ZERO, "work is reported once");
    }

    /// With the pool busy, a grammar that wants its state back before the pool's task started
    /// does the committed work itself; the task, finding it done, leaves it alone.
    #[test]
    fn a_busy_pool_leaves_the_work_to_the_grammar() {
        let (tokenizer, compiler, end) = setup();
        let spec = GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema"));
        let text = r#"{"a": 8, "b": "x"}"#;
        let expected = stepped_masks(&mut compiler.compile_new(&spec, &[end]).expect("compiles"), &tokenizer, text);
        let mut grammar = compiler.compile(&spec, &[end]).expect("compiles");
        // Work spawned from the only thread of this pool waits until the closure returns.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
        let got: Vec<Vec<u32>> = pool.install(|| {
            let tokens = tokenizer.encode(text, false).expect("encodes");
            tokens
                .iter()
                .map(|&t| {
                    let mask = grammar.masks(&[]).remove(0).expect("a mask").to_list();
                    grammar.commit(&[t]);
                    let queued = matches!(&*grammar.slot.lock().expect("not poisoned"), Slot::Advancing(a) if matches!(&*a.lock(), Stage::Queued(..)));
                    assert!(queued, "the pool's only thread is busy here");
                    mask
                })
                .collect()
        });
        assert_eq!(got, expected);
        assert_eq!(pool.install(|| rayon::join(|| 1, || 2)), (1, 2), "the pool's tasks returned");
    }

    /// A clone that ends gives its lexer states back (rolled back to the start) to the grammar it
    /// was cloned from; the next clone starts from them and computes the masks of a fresh grammar.

    #[test]
    fn ended_clones_give_their_lexer_states_to_the_next() {
        let (tokenizer, compiler, end) = setup();
        let spec = GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema"));
        let template = compiler.compile(&spec, &[end]).expect("compiles");
        let mut first = template.clone();
        let first_masks = stepped_masks(&mut first, &tokenizer, r#"{"a": 12, "b": "y"}"#);
        drop(first);
        let waited = Instant::now();
        while template.origin.lock().expect("not poisoned").given_back == 0 {
            assert!(waited.elapsed() < Duration::from_secs(10), "the ended clone never gave its states back");
            std::thread::sleep(Duration::from_millis(1));
        }
        for text in [r#"{"a": 12, "b": "y"}"#, r#"{"a": -40, "b": "x"}"#] {
            let mut fresh = compiler.compile_new(&spec, &[end]).expect("compiles");
            let expected = stepped_masks(&mut fresh, &tokenizer, text);
            assert_eq!(stepped_masks(&mut template.clone(), &tokenizer, text), expected, "{text}");
            if text.contains("12") {
                assert_eq!(expected, first_masks);
            }
        }
        // A clone that consumed nothing has nothing to give.
        drop(template.clone());
        std::thread::sleep(Duration::from_millis(20));
        assert!(template.origin.lock().expect("not poisoned").given_back >= 1);
    }

    /// A grammar compiled again from the same spec and end tokens is a clone of the first (it
    /// shares its lexer states); another spec or other end tokens compile anew, and only the
    /// latest grammars are kept.

    #[test]
    fn a_grammar_can_wait_for_a_token() {
        let (tokenizer, compiler, end) = setup();
        let start = tokenizer.token_to_id("<|im_start|>").expect("token");
        let mut grammar = compiler.compile(&GrammarSpec::Lark("start: \"hello\"".into()), &[end]).expect("compiles").starting_after(start);
        let free = tokenizer.encode("free text", false).expect("encodes");
        let mut drafts = free.clone();
        drafts.push(start);
        let masks = grammar.masks(&drafts);
        assert!(masks[..free.len() + 1].iter().all(Option::is_none), "no mask before the token and at it");
        assert!(masks[free.len() + 1].is_some(), "a mask right after it");
        grammar.commit(&drafts);
        let hello = tokenizer.encode("hello", false).expect("encodes");
        assert!(allowed(&grammar.masks(&[]).remove(0), hello[0]));
        assert!(!allowed(&grammar.masks(&[]).remove(0), free[0]) || free[0] == hello[0]);
    }

}
