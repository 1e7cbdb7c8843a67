//! Where a step's time goes on the host, phase by phase. With KESTREL_STEP_TRACE=1 the engine
//! times each phase of every step and prints the totals to stderr when it is dropped, so that
//! the host's share of a step (grammar masks, logits copies, host draws) can be told apart from
//! the forward's without a profiler.

use std::time::{Duration, Instant};

/// The phases of a step, in the order they run on the engine's thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Admission, preemption and the step's plan.
    Schedule,
    /// The forward (on a device backend: its launch), the grammar masks computed meanwhile.
    Forward,
    /// Waiting for the masks after the forward returned.
    MaskWait,
    /// Drawing the rows sampled on the backend and bringing the others to the host.
    DeviceDraw,
    /// Drawing the rows that came to the host.
    HostDraw,
    /// Accepting drafts, committing tokens (and grammar states), finishing requests.
    Commit,
    /// Drafts for the next step.
    Propose,
}

impl Phase {
    const ALL: [Phase; 7] = [Phase::Schedule, Phase::Forward, Phase::MaskWait, Phase::DeviceDraw, Phase::HostDraw, Phase::Commit, Phase::Propose];

    fn name(self) -> &'static str {
        match self {
            Phase::Schedule => "schedule",
            Phase::Forward => "forward",
            Phase::MaskWait => "mask wait",
            Phase::DeviceDraw => "device draw + copy",
            Phase::HostDraw => "host draw",
            Phase::Commit => "commit",
            Phase::Propose => "propose",
        }
    }
}

/// Totals of every phase over the steps an engine ran.
#[derive(Debug)]
pub struct StepTrace {
    totals: [Duration; Phase::ALL.len()],
    /// Time the grammar masks took, summed over the threads that computed them.
    mask_work: Duration,
    /// Time committing tokens to grammars took (part of [`Phase::Commit`]).
    grammar_commit: Duration,
    steps: u64,
    lap: Instant,
}

impl StepTrace {
    /// A trace when KESTREL_STEP_TRACE=1, else `None`.
    pub fn from_env() -> Option<StepTrace> {
        std::env::var("KESTREL_STEP_TRACE").is_ok_and(|v| v == "1").then(StepTrace::new)
    }

    pub fn new() -> StepTrace {
        StepTrace { totals: [Duration::ZERO; Phase::ALL.len()], mask_work: Duration::ZERO, grammar_commit: Duration::ZERO, steps: 0, lap: Instant::now() }
    }

    /// A step starts: the time since the last lap belongs to no phase.
    pub fn start_step(&mut self) {
        self.steps += 1;
        self.lap = Instant::now();
    }

    /// The time since the last lap was spent in `phase`.
    pub fn lap(&mut self, phase: Phase) {
        let now = Instant::now();
        self.totals[phase as usize] += now - self.lap;
        self.lap = now;
    }

    pub fn add_mask_work(&mut self, time: Duration) {
        self.mask_work += time;
    }

    pub fn add_grammar_commit(&mut self, time: Duration) {
        self.grammar_commit += time;
    }

    /// The total of `phase` so far.
    pub fn total(&self, phase: Phase) -> Duration {
        self.totals[phase as usize]
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One line per phase: total and mean per step, in milliseconds.
    pub fn report(&self) -> String {
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        let mut lines = vec![format!("kestrel: step trace over {} steps (ms total, ms per step)", self.steps)];
        let all: Duration = self.totals.iter().sum();
        for phase in Phase::ALL {
            let d = self.total(phase);
            lines.push(format!("  {:<20} {:>9.1} {:>8.3}", phase.name(), d.as_secs_f64() * 1e3, per_step(d)));
        }
        lines.push(format!("  {:<20} {:>9.1} {:>8.3}", "all phases", all.as_secs_f64() * 1e3, per_step(all)));
        lines.push(format!("  {:<20} {:>9.1} {:>8.3}", "masks (all threads)", self.mask_work.as_secs_f64() * 1e3, per_step(self.mask_work)));
        lines.push(format!("  {:<20} {:>9.1} {:>8.3}", "grammar commits", self.grammar_commit.as_secs_f64() * 1e3, per_step(self.grammar_commit)));
        lines.join("\n")
    }
}

impl Default for StepTrace {
    fn default() -> Self {
        StepTrace::new()
    }
}

impl Drop for StepTrace {
    fn drop(&mut self) {
        if self.steps > 0 {
            eprintln!("{}", self.report());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_by_phase() {
        let mut trace = StepTrace::new();
        trace.start_step();
        std::thread::sleep(Duration::from_millis(2));
        trace.lap(Phase::Forward);
        trace.lap(Phase::HostDraw);
        trace.add_mask_work(Duration::from_millis(3));
        assert_eq!(trace.steps(), 1);
        assert!(trace.total(Phase::Forward) >= Duration::from_millis(2));
        assert!(trace.total(Phase::HostDraw) < trace.total(Phase::Forward));
        let report = trace.report();
        assert!(report.contains("forward") && report.contains("masks (all threads)"), "{report}");
        // Dropped with steps recorded: prints the report (not captured here) without panicking.
    }
}
