//! Optional per-op device timing (`KESTREL_CUDA_PROFILE=1`): each Backend op records a pair
//! of events on the stream, so the split of a step's device time between ops can be read
//! without synchronizing inside the step.

use super::CudaBackend;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Host time spent in kernel launches and activation allocations (`KESTREL_CUDA_HOST_PROFILE=1`):
/// what part of the host's time to enqueue a step the driver calls take, when the host, not the
/// GPU, may set the pace.
#[derive(Default)]
pub(super) struct HostTimer {
    pub enabled: bool,
    launch_ns: AtomicU64,
    alloc_ns: AtomicU64,
    allocs: AtomicU64,
}

/// Host time in driver calls since the last [`CudaBackend::take_host_timing`].
#[derive(Debug, Clone, Copy, Default)]
pub struct HostTiming {
    /// Seconds in `cuLaunchKernelEx`.
    pub launch_s: f64,
    /// Seconds allocating activations from the stream's memory pool.
    pub alloc_s: f64,
    pub allocs: u64,
}

impl HostTimer {
    pub fn from_env() -> Self {
        HostTimer { enabled: std::env::var("KESTREL_CUDA_HOST_PROFILE").is_ok_and(|v| v == "1"), ..Default::default() }
    }

    /// Runs `f`, adding its wall time to the launch or the allocation total when enabled.
    pub fn time<T>(&self, allocation: bool, f: impl FnOnce() -> T) -> T {
        if !self.enabled {
            return f();
        }
        let start = std::time::Instant::now();
        let out = f();
        let ns = start.elapsed().as_nanos() as u64;
        if allocation {
            self.alloc_ns.fetch_add(ns, Ordering::Relaxed);
            self.allocs.fetch_add(1, Ordering::Relaxed);
        } else {
            self.launch_ns.fetch_add(ns, Ordering::Relaxed);
        }
        out
    }
}

impl CudaBackend {
    /// Host time in launches and allocations since the last call (zeros unless
    /// `KESTREL_CUDA_HOST_PROFILE=1`).
    pub fn take_host_timing(&self) -> HostTiming {
        let t = &self.host_timer;
        HostTiming {
            launch_s: t.launch_ns.swap(0, Ordering::Relaxed) as f64 / 1e9,
            alloc_s: t.alloc_ns.swap(0, Ordering::Relaxed) as f64 / 1e9,
            allocs: t.allocs.swap(0, Ordering::Relaxed),
        }
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

/// Marks per traced launch (TRACE_MARKS in cuda/common.cuh).
const TRACE_MARKS: usize = 4;

/// One traced launch: kernel name, and when (device ns) it became resident and its inputs were
/// ready; for the kernels that set them (0 otherwise), the marks of cuda/common.cuh.
pub struct TracedKernel {
    pub name: &'static str,
    pub grid: (u32, u32, u32),
    pub resident_ns: u64,
    pub ready_ns: u64,
    /// Block 0's first weights landed (streaming matmuls).
    pub first_data_ns: u64,
    /// The last block ended.
    pub end_ns: u64,
    /// Block 0's activation rows were ready for its k loop (streaming matmuls).
    pub rows_ready_ns: u64,
    /// Block 0 knew its group (grouped streaming matmuls), or the router's last block got its
    /// ticket.
    pub group_known_ns: u64,
}

impl Tracer {
    pub fn new(stream: &Arc<CudaStream>, modules: &[Arc<CudaModule>], names: Vec<(usize, &'static str)>) -> Result<Self, DriverError> {
        // Header, entries, then the marks (trace_mark in cuda/common.cuh).
        let mut header = vec![0u64; 2 + (2 + TRACE_MARKS) * TRACE_CAPACITY];
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
        let Ok(words) = self.stream.clone_dtoh(&*buffer) else { return Vec::new() };
        let count = (words[0] as usize).min(TRACE_CAPACITY).min(names.len());
        let marks = 2 + 2 * TRACE_CAPACITY;
        let out = (0..count)
            .map(|i| TracedKernel {
                name: names[i].0,
                grid: names[i].1,
                resident_ns: words[2 + 2 * i],
                ready_ns: words[3 + 2 * i],
                first_data_ns: words[marks + TRACE_MARKS * i],
                end_ns: words[marks + TRACE_MARKS * i + 1],
                rows_ready_ns: words[marks + TRACE_MARKS * i + 2],
                group_known_ns: words[marks + TRACE_MARKS * i + 3],
            })
            .collect();
        // The count and the marks (block ends are maxima) start again from zero; entries are
        // overwritten before they are read again.
        let mut head = buffer.slice_mut(0..1);
        let _ = self.stream.memcpy_htod(&[0u64], &mut head);
        let mut tail = buffer.slice_mut(marks..marks + TRACE_MARKS * TRACE_CAPACITY);
        let _ = self.stream.memset_zeros(&mut tail);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::HostTimer;
    use std::sync::atomic::Ordering;

    #[test]
    fn host_timer_counts_only_when_enabled() {
        let off = HostTimer::default();
        assert_eq!(off.time(true, || 7), 7);
        assert_eq!(off.allocs.load(Ordering::Relaxed), 0);
        let on = HostTimer { enabled: true, ..Default::default() };
        let slow = || std::thread::sleep(std::time::Duration::from_millis(2));
        on.time(true, slow);
        on.time(false, slow);
        on.time(false, slow);
        assert_eq!(on.allocs.load(Ordering::Relaxed), 1);
        assert!(on.alloc_ns.load(Ordering::Relaxed) >= 2_000_000);
        assert!(on.launch_ns.load(Ordering::Relaxed) >= 4_000_000);
    }
}
