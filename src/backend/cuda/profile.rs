//! Optional per-op device timing (`KESTREL_CUDA_PROFILE=1`): each Backend op records a pair
//! of events on the stream, so the split of a step's device time between ops can be read
//! without synchronizing inside the step.

use super::CudaBackend;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub(super) struct Profiler {
    pub enabled: bool,
    spans: Mutex<Vec<(&'static str, CudaEvent, CudaEvent)>>,
}

impl Profiler {
    pub fn from_env() -> Self {
        Profiler { enabled: std::env::var("KESTREL_CUDA_PROFILE").is_ok_and(|v| v == "1"), spans: Mutex::new(Vec::new()) }
    }
}

/// Records its end event when dropped.
pub(super) struct Span<'a> {
    be: &'a CudaBackend,
    name: &'static str,
    start: Option<CudaEvent>,
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        if let Some(start) = self.start.take() {
            if let Ok(end) = self.be.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
                self.be.profiler.spans.lock().unwrap_or_else(|p| p.into_inner()).push((self.name, start, end));
            }
        }
    }
}

impl CudaBackend {
    pub(super) fn span(&self, name: &'static str) -> Span<'_> {
        let start = if self.profiler.enabled { self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok() } else { None };
        Span { be: self, name, start }
    }

    /// Device milliseconds and call counts per op since the last report, largest first
    /// (empty unless `KESTREL_CUDA_PROFILE=1`). Waits for the stream.
    pub fn profile_report(&self) -> Vec<(&'static str, f64, usize)> {
        self.synchronize();
        let spans = std::mem::take(&mut *self.profiler.spans.lock().unwrap_or_else(|p| p.into_inner()));
        let mut totals: Vec<(&'static str, f64, usize)> = Vec::new();
        for (name, start, end) in spans {
            let ms = f64::from(start.elapsed_ms(&end).unwrap_or(0.0));
            match totals.iter_mut().find(|t| t.0 == name) {
                Some(t) => {
                    t.1 += ms;
                    t.2 += 1;
                }
                None => totals.push((name, ms, 1)),
            }
        }
        totals.sort_by(|a, b| b.1.total_cmp(&a.1));
        totals
    }
}

/// Entries the start-time trace holds (about 20 steps of the largest model).
const TRACE_CAPACITY: usize = 1 << 14;

/// Kernel start times on the device (`KESTREL_CUDA_TRACE=1`). The kernels are compiled with
/// KESTREL_TRACE: the first block of each records when it became resident and when its inputs
/// were ready (wait_for_inputs in cuda/common.cuh). With dependent launch the kernels overlap,
/// so a profiler that runs them one by one (ncu) cannot show where a step's time goes; the gap
/// from one kernel's inputs-ready time to the next one's can.
pub(super) struct Tracer {
    buffer: Mutex<CudaSlice<u64>>,
    names: HashMap<usize, &'static str>,
    launched: Mutex<Vec<(&'static str, (u32, u32, u32))>>,
}

/// One traced launch: kernel name, and when (device ns) it became resident and its inputs were ready.
pub struct TracedKernel {
    pub name: &'static str,
    pub grid: (u32, u32, u32),
    pub resident_ns: u64,
    pub ready_ns: u64,
}

impl Tracer {
    pub fn new(stream: &Arc<CudaStream>, modules: &[Arc<CudaModule>], names: Vec<(usize, &'static str)>) -> Result<Self, DriverError> {
        let mut header = vec![0u64; 2 + 2 * TRACE_CAPACITY];
        header[1] = TRACE_CAPACITY as u64;
        let buffer = stream.clone_htod(&header)?;
        let address = buffer.device_ptr(stream).0;
        for m in modules {
            let mut global = m.get_global("kestrel_trace", stream)?;
            stream.memcpy_htod(&address.to_ne_bytes(), &mut global)?;
        }
        stream.synchronize()?;
        Ok(Tracer { buffer: Mutex::new(buffer), names: names.into_iter().collect(), launched: Mutex::new(Vec::new()) })
    }

    pub fn launched(&self, f: &CudaFunction, grid: (u32, u32, u32)) {
        let name = self.names.get(&(f.cu_function() as usize)).copied().unwrap_or("?");
        self.launched.lock().unwrap_or_else(|p| p.into_inner()).push((name, grid));
    }
}

impl CudaBackend {
    /// The kernels traced since the last call, in launch order, and a fresh trace (empty unless
    /// `KESTREL_CUDA_TRACE=1`; launches past the capacity are dropped). Waits for the stream.
    /// Names come from the host's launches, so trace eager steps: a graph replay records start
    /// times that no launch names.
    pub fn take_trace(&self) -> Vec<TracedKernel> {
        let Some(t) = &self.tracer else { return Vec::new() };
        self.synchronize();
        let names = std::mem::take(&mut *t.launched.lock().unwrap_or_else(|p| p.into_inner()));
        let mut buffer = t.buffer.lock().unwrap_or_else(|p| p.into_inner());
        // The header and the entries of the launches made since the last call.
        let used = 2 + 2 * names.len().min(TRACE_CAPACITY);
        let Ok(words) = self.stream.clone_dtoh(&buffer.slice(0..used)) else { return Vec::new() };
        let count = (words[0] as usize).min(TRACE_CAPACITY).min(names.len());
        let out = (0..count).map(|i| TracedKernel { name: names[i].0, grid: names[i].1, resident_ns: words[2 + 2 * i], ready_ns: words[3 + 2 * i] }).collect();
        // Only the count needs resetting: entries are overwritten before they are read again.
        let mut head = buffer.slice_mut(0..1);
        let _ = self.stream.memcpy_htod(&[0u64], &mut head);
        out
    }
}
