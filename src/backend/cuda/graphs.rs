//! CUDA graphs of whole decode forwards (DESIGN Invariant 4).
//!
//! A forward of generate rows only (decodes and verify rows, every token sampled) launches the
//! same kernels with the same arguments for a given row and token count: its per-step inputs
//! (ids, the packed layout, the logits rows) sit in persistent buffers at fixed addresses, with
//! offsets that depend only on those counts (see layout.rs), and every grid size is a function
//! of the shapes. So the first such forward of each key is captured, and later steps write
//! their inputs into those buffers and replay it. The engine pads steps up to capture sizes,
//! whose keys are captured at start-up (or after one eager forward, [`CaptureWhen::Now`]),
//! each after an eager forward of its shape has made what such a forward makes on first use
//! (rope tables, run-time compiled kernels: a capture would record their uploads); a step no capture
//! size holds keeps its exact key, captured on its [`CAPTURE_AFTER`]th forward (a capture costs
//! a few eager forwards, and such keys may occur only once or twice). Past [`MAX_GRAPHS`] keys,
//! forwards run eagerly. Outputs are token-indexed; only the real tokens' rows are copied out.
//!
//! Activations are allocated inside the graph (stream-ordered allocation nodes) and all of
//! them are freed inside it too: the outputs are first copied into buffers shared by every
//! graph (graphs run one at a time and each step copies its outputs out at once), so graphs
//! can share their activation memory. A new cache (other KV and state addresses) drops every
//! graph, and so does growing the shared output buffers.
//!
//! The MTP drafter's forwards are graphs of their own ([`GraphedForward::Mtp`] keys): besides
//! the ids they read a hidden-state input, which is gathered (eagerly, before the launch) into
//! a tensor kept per (padded tokens, width) at a fixed address for the backend's life.

use super::{ck, CudaBackend, CudaTensor};
use cudarc::driver::CudaSlice;
use crate::backend::{Backend, BackendError, CaptureWhen, ChainLink, GraphInputs, GraphKey, Real};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Most graphs kept: every row count with every verify-row length of a busy engine.
const MAX_GRAPHS: usize = 512;

/// Forwards of one key before it is captured (the earlier ones run eagerly).
const CAPTURE_AFTER: u32 = 3;

struct CapturedForward {
    /// Shapes of the outputs the graph leaves in the shared output buffers.
    shapes: Vec<(usize, usize)>,
    graph: OwnedGraph,
}

/// An instantiated graph that may move to the engine thread with its backend.
struct OwnedGraph(CudaGraph);

// SAFETY: driver handles are not tied to the thread that made them; cudarc binds the context
// to the calling thread before every graph call, and the graphs sit behind the backend's mutex,
// so one thread uses a graph at a time.
unsafe impl Send for OwnedGraph {}

#[derive(Default)]
pub(super) struct Graphs {
    by_key: HashMap<GraphKey, CapturedForward>,
    /// Forwards seen per key not captured yet.
    seen: HashMap<GraphKey, u32>,
    /// Where every graph leaves output `i` (see the module comment).
    outputs: Vec<CudaSlice<f32>>,
    /// The hidden-state inputs of graphs that read one, per (rows, cols); never freed, since
    /// graphs hold their addresses.
    hidden_inputs: HashMap<(usize, usize), CudaTensor>,
}

impl Graphs {
    pub fn clear(&mut self) {
        self.by_key.clear();
        self.seen.clear();
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }
}

impl CudaBackend {
    /// Copies of the first `real` rows of a graph's outputs out of the shared buffers.
    fn read_graph_outputs(&self, buffers: &[CudaSlice<f32>], shapes: &[(usize, usize)], real: Real) -> Vec<CudaTensor> {
        shapes
            .iter()
            .zip(buffers)
            .map(|(&(rows, cols), buf)| {
                assert!(real.0 <= rows, "a graph output of {rows} rows cannot hold {} real rows", real.0);
                let mut out = self.tensor(real.0, cols);
                if real.0 > 0 {
                    ck(self.stream.memcpy_dtod(&buf.slice(0..real.0 * cols), &mut out.data), "graph output copy");
                }
                out
            })
            .collect()
    }

    /// The first `real` rows of eager outputs.
    fn cut_outputs(&self, outputs: Vec<CudaTensor>, real: Real) -> Vec<CudaTensor> {
        outputs.into_iter().map(|t| if t.rows == real.0 { t } else { self.first_rows(&t, real) }).collect()
    }

    /// Writes a graphed forward's inputs to the persistent buffers its kernels read.
    fn write_graph_inputs(&self, inputs: &GraphInputs<'_>) {
        let mut step = self.step_inputs();
        let ids: Vec<i32> = inputs.ids.iter().map(|&i| i as i32).collect();
        step.ids.write(self, &ids);
        step.layout(self, inputs.layout, inputs.block_size);
        let rows: Vec<i32> = inputs.logit_rows.iter().map(|&r| r as i32).collect();
        step.gather.write(self, &rows);
    }

    pub(super) fn run_graphed_forward(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        self.run_graphed_with(inputs, None, None, &mut |_| forward())
    }

    /// [`Backend::run_graphed_on_rows`]: rows `rows` of `x` gathered into the fixed hidden
    /// input of the padded token count, which `forward` reads.
    pub(super) fn run_graphed_forward_on_rows(&self, inputs: &GraphInputs<'_>, x: &CudaTensor, rows: &[u32], forward: &mut dyn FnMut(&CudaTensor) -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        assert_eq!(rows.len(), inputs.real.tokens.0, "a hidden-state row per real token");
        self.run_graphed_with(inputs, Some((x, rows)), None, &mut |h| forward(h.expect("a hidden-state input")))
    }

    /// [`Backend::run_graphed_chain`]: every argmax written to one device buffer, the next
    /// link's ids copied from it on the device, the buffer read back once at the end.
    pub(super) fn run_graphed_chain_on_device(&self, logits: &CudaTensor, hidden: &CudaTensor, links: &[ChainLink<'_>], forward: &mut dyn FnMut(&GraphInputs<'_>, &CudaTensor) -> Vec<CudaTensor>) -> Vec<Vec<u32>> {
        let counts: Vec<usize> = std::iter::once(logits.rows).chain(links.iter().map(|l| l.inputs.real.rows.0)).collect();
        let drafts = self.alloc_i32(counts.iter().sum());
        let at = |offset: usize| self.ptr(&drafts) + (offset * std::mem::size_of::<i32>()) as u64;
        super::sample::greedy_rows_into(self, logits, at(0));
        let (mut previous, mut offset) = (0, logits.rows);
        let mut last_hidden: Option<CudaTensor> = None;
        for (link, &count) in links.iter().zip(&counts[1..]) {
            assert_eq!(link.prev_rows.len(), count, "a previous row per real row of a chained forward");
            let x = last_hidden.as_ref().unwrap_or(hidden);
            let mut outputs = self.run_graphed_with(&link.inputs, Some((x, &link.prev_rows)), Some((at(previous), &link.prev_rows)), &mut |h| forward(&link.inputs, h.expect("a hidden-state input")));
            let step_logits = outputs.pop().expect("a drafter forward returns hidden states and logits");
            last_hidden = Some(outputs.pop().expect("a drafter forward returns hidden states and logits"));
            super::sample::greedy_rows_into(self, &step_logits, at(offset));
            previous = offset;
            offset += count;
        }
        let all = ck(self.stream.clone_dtoh(&drafts), "drafts copy");
        let mut start = 0;
        counts
            .iter()
            .map(|&n| {
                // The kernel's -1 is NO_FINITE_LOGIT read as unsigned.
                let step = all[start..start + n].iter().map(|&t| t as u32).collect();
                start += n;
                step
            })
            .collect()
    }

    /// Runs or replays `inputs`' forward; with `ids_from` (a device address of i32 drafts and
    /// the rows of them that are the real rows' ids), the ids buffer gets those ids on the
    /// device after the host's placeholder ids are written, and forgets what it held after.
    fn run_graphed_with(&self, inputs: &GraphInputs<'_>, hidden: Option<(&CudaTensor, &[u32])>, ids_from: Option<(u64, &[u32])>, forward: &mut dyn FnMut(Option<&CudaTensor>) -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        let outputs = self.run_graphed_inner(inputs, hidden, ids_from, forward);
        if ids_from.is_some() {
            self.step_inputs().ids.forget();
        }
        outputs
    }

    fn run_graphed_inner(&self, inputs: &GraphInputs<'_>, hidden: Option<(&CudaTensor, &[u32])>, ids_from: Option<(u64, &[u32])>, forward: &mut dyn FnMut(Option<&CudaTensor>) -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        let real = inputs.real_output_rows();
        let key = inputs.key();
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        // Before the step's own inputs: the gather's row list goes through the gather buffer.
        let staged = hidden.map(|(x, rows)| self.stage_hidden_input(&mut graphs, x, rows, inputs.padded.tokens.0));
        self.write_graph_inputs(inputs);
        if let Some((drafts, rows)) = ids_from {
            // Over the placeholders just written, which the buffer still claims to hold: an eager
            // forward's embedding finds its (placeholder) ids in place and copies nothing.
            let ids = self.step_inputs().ids.write(self, &[]);
            super::sample::write_draft_ids(self, ids, drafts, rows);
        }
        // Per-op timing records events between launches; it measures the plain launches.
        if self.profiler.enabled {
            return self.eager_with(graphs, staged, real, forward);
        }
        if !graphs.by_key.contains_key(&key) {
            let seen = graphs.seen.entry(key).or_insert(0);
            *seen += 1;
            let wait = *seen < if inputs.capture == CaptureWhen::Now { 2 } else { CAPTURE_AFTER };
            if wait || graphs.by_key.len() >= MAX_GRAPHS {
                return self.eager_with(graphs, staged, real, forward);
            }
            self.capture_with(&mut graphs, key, staged, forward);
        }
        let captured = &graphs.by_key[&key];
        // Capturing ran nothing: a launch computes the step.
        ck(captured.graph.0.launch(), "graph launch");
        self.read_graph_outputs(&graphs.outputs, &captured.shapes, real)
    }

    /// Runs `forward` eagerly on the staged hidden input (if any), outputs cut to `real` rows.
    fn eager_with(&self, mut graphs: std::sync::MutexGuard<'_, Graphs>, staged: Option<(usize, usize)>, real: Real, forward: &mut dyn FnMut(Option<&CudaTensor>) -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        // The input leaves the map while `forward` runs without the lock (it may take it again).
        let input = staged.map(|k| (k, graphs.hidden_inputs.remove(&k).expect("staged above")));
        drop(graphs);
        let outputs = forward(input.as_ref().map(|(_, t)| t));
        if let Some((k, t)) = input {
            self.graphs.lock().unwrap_or_else(|p| p.into_inner()).hidden_inputs.insert(k, t);
        }
        self.cut_outputs(outputs, real)
    }

    /// Gathers rows `rows` of `x` into the first rows of the fixed hidden input of `tokens`
    /// rows (allocated on first use, zeros: the padded tokens' rows hold zeros or what earlier
    /// steps left, finite either way); returns its key.
    fn stage_hidden_input(&self, graphs: &mut Graphs, x: &CudaTensor, rows: &[u32], tokens: usize) -> (usize, usize) {
        assert!(rows.len() <= tokens, "{} hidden-state rows for {tokens} tokens", rows.len());
        if let Some(&bad) = rows.iter().find(|&&r| r as usize >= x.rows) {
            panic!("hidden input: row {bad} outside {} rows", x.rows);
        }
        let key = (tokens, x.cols);
        let input = graphs.hidden_inputs.entry(key).or_insert_with(|| {
            assert!(!self.capturing(), "a hidden input allocated inside a graph capture");
            CudaTensor { data: ck(self.stream.alloc_zeros::<f32>((tokens * x.cols).max(1)), "graph hidden input"), rows: tokens, cols: x.cols }
        });
        self.gather_rows_into(input, x, rows);
        key
    }

    /// Captures (and runs once) the graph of a step of padded rows only, ahead of the steps
    /// that will replay it.
    pub(super) fn prepare_graphed_forward(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Result<bool, BackendError> {
        self.prepare_graphed_with(inputs, None, &mut |_| forward())
    }

    /// [`Backend::prepare_graph_on_rows`].
    pub(super) fn prepare_graphed_forward_on_rows(&self, inputs: &GraphInputs<'_>, cols: usize, forward: &mut dyn FnMut(&CudaTensor) -> Vec<CudaTensor>) -> Result<bool, BackendError> {
        self.prepare_graphed_with(inputs, Some(cols), &mut |h| forward(h.expect("a hidden-state input")))
    }

    fn prepare_graphed_with(&self, inputs: &GraphInputs<'_>, hidden_cols: Option<usize>, forward: &mut dyn FnMut(Option<&CudaTensor>) -> Vec<CudaTensor>) -> Result<bool, BackendError> {
        if self.profiler.enabled {
            return Ok(false);
        }
        if inputs.real.rows.0 != 0 {
            return Err(BackendError::Invalid("a graph prepared ahead of its steps must have padded rows only".into()));
        }
        let key = inputs.key();
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let staged = hidden_cols.map(|cols| {
            let none = CudaTensor { data: ck(self.stream.alloc_zeros::<f32>(cols), "alloc"), rows: 1, cols };
            self.stage_hidden_input(&mut graphs, &none, &[], inputs.padded.tokens.0)
        });
        self.write_graph_inputs(inputs);
        if !graphs.by_key.contains_key(&key) {
            if graphs.by_key.len() >= MAX_GRAPHS {
                return Ok(false);
            }
            self.capture_with(&mut graphs, key, staged, forward);
        }
        // The first launch maps the graph's activation memory: pay for it now.
        ck(graphs.by_key[&key].graph.0.launch(), "graph launch");
        ck(self.stream.synchronize(), "graph warm-up");
        Ok(true)
    }

    /// Captures `forward` (reading the staged hidden input, if any) as the graph of `key`.
    fn capture_with(&self, graphs: &mut Graphs, key: GraphKey, staged: Option<(usize, usize)>, forward: &mut dyn FnMut(Option<&CudaTensor>) -> Vec<CudaTensor>) {
        // The second attempt fits: the first grows the shared output buffers when they are small.
        for _ in 0..2 {
            ck(self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin graph capture");
            self.capturing.store(true, Ordering::Relaxed);
            let buffers = &mut graphs.outputs;
            let input = staged.map(|k| &graphs.hidden_inputs[&k]);
            // A panic inside the capture (an op refusing its input) must still end it.
            let captured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let outputs = forward(input);
                let shapes: Vec<(usize, usize)> = outputs.iter().map(|t| (t.rows, t.cols)).collect();
                let fits = buffers.len() >= outputs.len() && outputs.iter().zip(buffers.iter()).all(|(t, b)| b.len() >= t.rows * t.cols);
                if fits {
                    for (t, buf) in outputs.iter().zip(buffers.iter_mut()) {
                        ck(self.stream.memcpy_dtod(&t.data, &mut buf.slice_mut(0..t.rows * t.cols)), "graph output copy");
                    }
                }
                // Dropped inside the capture: the graph frees every allocation it makes.
                drop(outputs);
                (shapes, fits)
            }));
            self.capturing.store(false, Ordering::Relaxed);
            let graph = self.stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            let (shapes, fits) = match captured {
                Ok(c) => c,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            let graph = ck(graph, "end graph capture").expect("a captured forward has kernels");
            if !fits {
                drop(graph);
                // Existing graphs write to the old buffers.
                graphs.clear();
                // Doubling: a workload whose steps keep growing regrows (and recaptures) rarely.
                let old: Vec<usize> = graphs.outputs.iter().map(|b| b.len()).collect();
                graphs.outputs = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, &(r, c))| ck(self.stream.alloc_zeros::<f32>((r * c).max(2 * old.get(i).copied().unwrap_or(0)).max(1)), "graph output buffer"))
                    .collect();
                continue;
            }
            graphs.by_key.insert(key, CapturedForward { shapes, graph: OwnedGraph(graph) });
            graphs.seen.remove(&key);
            return;
        }
        unreachable!("the shared output buffers fit after growing")
    }

    /// Graphs captured so far (for tests and reports).
    pub fn captured_graphs(&self) -> usize {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Drops every captured graph (their kernels hold addresses of the old cache).
    pub(super) fn drop_graphs(&self) {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}
