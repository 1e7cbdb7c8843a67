//! The step's forward, padded to a capture size and replayed as a graph where it can be, and
//! the capture of every capture size at start-up.

use super::padding::{fits, pad_step, padded_shape, real_shape, CaptureSizes, PadLimits, PaddedStep, Scratch};
use super::plan::StepPlan;
use super::spec::mtp::capture_mtp_at_startup;
use crate::backend::{Backend, CaptureWhen, GraphInputs, GraphedForward, Padded, PaddedShape, RealShape, RowKind};
use crate::model::arch::qwen35::{ForwardOutput, Qwen35};
use std::time::{Duration, Instant};

/// How generate-only steps are padded; `sizes` empty: every step keeps its exact shape.
#[derive(Debug, Clone)]
pub struct GraphPadding {
    pub sizes: CaptureSizes,
    pub scratch: Scratch,
    pub limits: PadLimits,
    /// Drafts per row at most (k).
    pub k: usize,
}

/// What capturing the graphs at start-up took.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureReport {
    /// Graphs captured, the drafter's included.
    pub graphs: usize,
    /// Of those, the MTP drafter's.
    pub drafter_graphs: usize,
    pub time: Duration,
    /// Device memory the graphs hold, where the backend can tell.
    pub bytes: Option<usize>,
}

/// The shapes captured at start-up, largest first (the shared output buffers then grow once):
/// every row size with one token per row, and with `speculating` every token multiple too.
pub fn startup_shapes(padding: &GraphPadding, speculating: bool) -> Vec<PaddedShape> {
    let multiples = if speculating { CaptureSizes::token_multiples(padding.k) } else { vec![1] };
    let mut shapes = Vec::new();
    for &rows in padding.sizes.sizes().iter().rev() {
        for &m in multiples.iter().rev() {
            let shape = PaddedShape { rows: Padded(rows), tokens: Padded(rows * m) };
            if shape.tokens.0 <= padding.limits.max_tokens && fits(shape, RealShape::default(), padding.limits) {
                shapes.push(shape);
            }
        }
    }
    shapes
}

/// Captures the graph of every start-up shape: steps of padded rows only, which touch nothing
/// but scratch memory; with `drafter` (MTP speculation), the MTP drafter's forward at every
/// one of those shapes too (a catch-up has up to k + 1 tokens per row, a chained draft one).
/// `None` where the backend does not replay graphs.
pub fn capture_at_startup<B: Backend>(model: &Qwen35<B>, backend: &B, cache: &mut B::Cache, padding: &GraphPadding, speculating: bool, drafter: bool, progress: &indicatif::ProgressBar) -> Option<CaptureReport> {
    if padding.sizes.is_empty() || !backend.replays_graphs() {
        return None;
    }
    let shapes = startup_shapes(padding, speculating);
    let drafter_shapes = if drafter && model.mtp.is_some() { startup_shapes(padding, true) } else { Vec::new() };
    let started = Instant::now();
    let before = backend.device_memory_used();
    progress.set_length((shapes.len() + drafter_shapes.len()) as u64);
    let mut graphs = 0;
    for shape in shapes {
        let step = pad_step(&StepPlan::default(), shape, padding.scratch, padding.limits.block_size);
        let inputs = graph_inputs(&step, padding.limits.block_size, CaptureWhen::Now);
        // One eager run first: whatever a forward of this shape makes on first use (rope
        // tables, kernels compiled at run time, column lists) must exist before a capture,
        // which would record its upload instead of running it.
        let _ = model.forward(backend, inputs.ids, inputs.layout, inputs.logit_rows, cache);
        let captured = backend.prepare_graph(&inputs, &mut || {
            let out = model.forward(backend, inputs.ids, inputs.layout, inputs.logit_rows, cache);
            vec![out.hidden, out.logits]
        });
        match captured {
            Ok(true) => graphs += 1,
            Ok(false) => {}
            Err(e) => {
                progress.println(format!("kestrel: graph of {} rows, {} tokens not captured: {e}", shape.rows.0, shape.tokens.0));
            }
        }
        progress.inc(1);
    }
    let drafter_graphs = capture_mtp_at_startup(model, backend, cache, padding, &drafter_shapes, progress);
    let bytes = before.zip(backend.device_memory_used()).map(|(b, a)| a.saturating_sub(b));
    Some(CaptureReport { graphs: graphs + drafter_graphs, drafter_graphs, time: started.elapsed(), bytes })
}

fn graph_inputs(step: &PaddedStep, block_size: usize, capture: CaptureWhen) -> GraphInputs<'_> {
    GraphInputs { forward: GraphedForward::Step, ids: &step.ids, layout: &step.layout, logit_rows: &step.logit_rows, block_size, real: step.real, padded: step.shape, capture }
}

/// Whether a plan is a step of decode and verify rows only (each from its one unfed token on,
/// every token sampled): its launch sequence is fixed by its row and token counts.
pub fn generate_only(plan: &StepPlan) -> bool {
    plan.rows.iter().all(|r| r.kind == RowKind::Generate && r.committed == 1 && r.logits_start.is_some())
        && plan.logit_rows.len() == plan.num_tokens()
        && plan.logit_rows.iter().enumerate().all(|(i, &t)| t as usize == i)
}

/// The step's forward. A generate-only step is padded up to the smallest capture size that
/// holds it (or keeps its exact shape where none does) and handed to the backend, which may
/// replay it as a graph and returns the real tokens' rows only. Returns the shapes of a step
/// run at a capture size.
pub fn forward<B: Backend>(model: &Qwen35<B>, backend: &B, cache: &mut B::Cache, graphs: Option<&GraphPadding>, plan: &StepPlan, block_size: usize) -> (ForwardOutput<B>, Option<(RealShape, PaddedShape)>) {
    let Some(padding) = graphs.filter(|_| generate_only(plan)) else {
        return (model.forward(backend, &plan.ids.0, &plan.layout, &plan.logit_rows, cache), None);
    };
    let real = real_shape(plan);
    let (step, capture) = match padded_shape(&padding.sizes, real, padding.k, padding.limits) {
        Some(shape) => (pad_step(plan, shape, padding.scratch, block_size), CaptureWhen::Now),
        None => (PaddedStep { ids: plan.ids.0.clone(), layout: plan.layout.clone(), logit_rows: plan.logit_rows.clone(), real, shape: PaddedShape::exact(real) }, CaptureWhen::AfterRepeats),
    };
    let at_capture_size = capture == CaptureWhen::Now;
    let inputs = graph_inputs(&step, block_size, capture);
    let mut outputs = backend.run_graphed(&inputs, &mut || {
        let out = model.forward(backend, inputs.ids, inputs.layout, inputs.logit_rows, cache);
        vec![out.hidden, out.logits]
    });
    let logits = outputs.pop().expect("a graphed forward returns hidden and logits");
    let hidden = outputs.pop().expect("a graphed forward returns hidden and logits");
    (ForwardOutput { hidden, logits }, at_capture_size.then_some((real, step.shape)))
}
