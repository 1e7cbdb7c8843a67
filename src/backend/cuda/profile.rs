//! Optional per-op device timing (`KESTREL_CUDA_PROFILE=1`): each Backend op records a pair
//! of events on the stream, so the split of a step's device time between ops can be read
//! without synchronizing inside the step.

use super::CudaBackend;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;
use std::sync::Mutex;

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
