//! What a graphed forward is keyed by and fed with, and the two counts it keeps apart
//! (DESIGN Invariant 2): the rows and tokens of the step's real requests, and the rows and
//! tokens of the capture size the step is padded up to. A padded step runs padded rows that
//! touch only scratch cache memory; its outputs are cut back to the real tokens before they
//! leave the backend. The two counts are distinct types, so that one cannot stand for the
//! other: comparing or mixing them does not compile.
//!
//! ```compile_fail
//! use kestrel::backend::graph_step::{Padded, Real};
//! // A real count is not a padded count.
//! let same = Real(17) == Padded(24);
//! ```
//!
//! ```compile_fail
//! use kestrel::backend::graph_step::{GraphedForward, Real, RealShape};
//! // A graph key is made from a padded shape only.
//! let key = kestrel::backend::GraphKey::new(GraphedForward::Step, RealShape { rows: Real(1), tokens: Real(1) });
//! ```

use crate::backend::BatchLayout;

/// A count of the step's real rows or tokens (requests the engine scheduled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Real(pub usize);

/// A count of rows or tokens after padding up to a capture size (real ones included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Padded(pub usize);

impl Padded {
    /// How many of these are padding over `real` (which they include).
    pub fn extra_over(self, real: Real) -> usize {
        debug_assert!(self.0 >= real.0, "a padded count below its real count");
        self.0 - real.0
    }

    /// Whether `real` fits.
    pub fn holds(self, real: Real) -> bool {
        self.0 >= real.0
    }
}

/// Rows and tokens of a step's real requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RealShape {
    pub rows: Real,
    pub tokens: Real,
}

/// Rows and tokens a graphed step runs with: its real rows and tokens first, then padded rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PaddedShape {
    pub rows: Padded,
    pub tokens: Padded,
}

impl PaddedShape {
    /// A step run at its own shape (no padding).
    pub fn exact(real: RealShape) -> PaddedShape {
        PaddedShape { rows: Padded(real.rows.0), tokens: Padded(real.tokens.0) }
    }

    pub fn holds(&self, real: RealShape) -> bool {
        self.rows.holds(real.rows) && self.tokens.holds(real.tokens)
    }
}

/// Which forward a graph replays: two forwards of the same shape launch different kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GraphedForward {
    /// The model's step: generate rows (decodes and verify rows), every token with a logits
    /// row; its outputs have a row per token.
    Step,
    /// One forward of the MTP drafter (a catch-up or a chained draft): rows of the drafter's
    /// layer with a hidden-state input per token, a logits row at every row's last token; its
    /// outputs have a row per row.
    Mtp,
}

/// What fixes the launch sequence of a forward that can be replayed as a CUDA graph: the
/// forward, its `rows` rows and `tokens` tokens in all. Everything else a step varies (ids,
/// positions, how the tokens split into rows, block tables, state and snapshot slots, the
/// drafter's hidden-state input) is read from persistent device buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub forward: GraphedForward,
    pub rows: Padded,
    pub tokens: Padded,
}

impl GraphKey {
    pub fn new(forward: GraphedForward, shape: PaddedShape) -> GraphKey {
        GraphKey { forward, rows: shape.rows, tokens: shape.tokens }
    }
}

/// When a backend that replays graphs captures one for a key it has not seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureWhen {
    /// Soon: a capture size, which every later step of its shape will replay (captured at
    /// start-up, or after one eager forward, which makes what a forward of its shape makes on
    /// first use).
    Now,
    /// After the key recurs a few times (an exact shape no capture size holds).
    AfterRepeats,
}

/// The per-step inputs of a graphed forward (the padded step's), written to the device before
/// it runs or replays.
pub struct GraphInputs<'a> {
    pub forward: GraphedForward,
    pub ids: &'a [u32],
    pub layout: &'a BatchLayout,
    /// Rows of the final hidden state that get logits (a step: every token, 0, 1, ...; the
    /// drafter: every row's last token).
    pub logit_rows: &'a [u32],
    pub block_size: usize,
    /// The real rows and tokens: the first ones of the padded step.
    pub real: RealShape,
    pub padded: PaddedShape,
    pub capture: CaptureWhen,
}

impl GraphInputs<'_> {
    pub fn key(&self) -> GraphKey {
        GraphKey::new(self.forward, self.padded)
    }

    /// How many of the outputs' rows are real (the first ones): a row per real token of a
    /// step, per real row of a drafter forward.
    pub fn real_output_rows(&self) -> Real {
        match self.forward {
            GraphedForward::Step => self.real.tokens,
            GraphedForward::Mtp => self.real.rows,
        }
    }

    /// Rows of every output, padded ones included.
    pub fn padded_output_rows(&self) -> Padded {
        match self.forward {
            GraphedForward::Step => self.padded.tokens,
            GraphedForward::Mtp => self.padded.rows,
        }
    }
}

/// One forward of a drafter chain ([`crate::backend::Backend::run_graphed_chain`]): its
/// padded inputs, whose real rows' ids are placeholders (they are the previous forward's
/// argmax, known only on the device), and for each real row the row of the previous forward's
/// outputs it continues (whose argmax is its id, and whose hidden state its input).
pub struct ChainLink<'a> {
    pub inputs: GraphInputs<'a>,
    pub prev_rows: Vec<u32>,
}
