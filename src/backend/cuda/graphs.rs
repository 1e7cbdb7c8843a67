//! CUDA graphs of whole decode forwards (DESIGN Invariant 4).
//!
//! A forward of `rows` one-token generate rows launches the same kernels with the same
//! arguments every step: its per-step inputs (ids, the packed layout, the logits rows) sit in
//! persistent buffers at fixed addresses, with offsets that depend only on the row count
//! (see layout.rs), and every grid size is a function of the shapes. So the first such forward
//! is captured, and later steps write their inputs into those buffers and replay it.
//!
//! Activations are allocated inside the graph (stream-ordered allocation nodes), at addresses
//! fixed for the life of the graph; the outputs are not freed in the graph, so the graph is
//! instantiated to free them itself on relaunch, and each replay hands out copies of them.
//! A new cache (other KV and state addresses) drops every graph.

use super::{ck, CudaBackend, CudaTensor};
use crate::backend::{GraphInputs, GraphKey};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

struct CapturedForward {
    /// Declared before the graph: these graph allocations are freed before it is destroyed.
    outputs: Vec<CudaTensor>,
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
}

impl Graphs {
    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }
}

impl CudaBackend {
    fn copy_tensor(&self, t: &CudaTensor) -> CudaTensor {
        let mut out = self.tensor(t.rows, t.cols);
        ck(self.stream.memcpy_dtod(&t.data, &mut out.data), "graph output copy");
        out
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

    pub(super) fn run_graphed_forward(&self, key: GraphKey, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        // Per-op timing records events between launches; it measures the plain launches.
        if self.profiler.enabled {
            return forward();
        }
        self.write_graph_inputs(inputs);
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(captured) = graphs.by_key.get(&key) {
            ck(captured.graph.0.launch(), "graph launch");
            return captured.outputs.iter().map(|t| self.copy_tensor(t)).collect();
        }
        ck(self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin graph capture");
        self.capturing.store(true, Ordering::Relaxed);
        // A panic inside the capture (an op refusing its input) must still end it.
        let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *forward));
        self.capturing.store(false, Ordering::Relaxed);
        let graph = self.stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let outputs = match outputs {
            Ok(o) => o,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        let graph = ck(graph, "end graph capture").expect("a captured forward has kernels");
        // Capturing ran nothing: this launch computes the step.
        ck(graph.launch(), "graph launch");
        let copies = outputs.iter().map(|t| self.copy_tensor(t)).collect();
        graphs.by_key.insert(key, CapturedForward { outputs, graph: OwnedGraph(graph) });
        copies
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
