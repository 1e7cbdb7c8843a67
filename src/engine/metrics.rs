//! Speculation and latency metrics, defined as in DESIGN ("Spec metrics") and the benchmark contract.
//!
//! Speculation counts follow vLLM so that figures are comparable: a *draft step* is a decode/verify
//! step of one request that carried at least one draft, and the acceptance figures are taken over
//! draft steps only. Because that overstates the gain of a proposer that often drafts nothing (ngram),
//! `tokens_per_forward` is also kept over every decode/verify step, drafts or not.
//!
//! Latencies follow `vllm bench serve`: TTFT is arrival to the first streamed chunk, TPOT is
//! `(e2e - ttft) / (output_tokens - 1)`, and ITL is the gap between consecutive streamed chunks, so a
//! chunk that carries several accepted tokens counts once.

use std::fmt::Write as _;
use std::time::Instant;

use thiserror::Error;

/// Why a metric update or export was refused.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MetricsError {
    #[error("a step cannot accept {accepted} drafts when only {drafted} were drafted")]
    AcceptedExceedsDrafted { drafted: usize, accepted: usize },
    #[error("timeline times must be finite seconds, got {0}")]
    NonFiniteTime(f64),
    #[error("timeline event at {time}s is earlier than the previous event at {previous}s")]
    TimeWentBackwards { time: f64, previous: f64 },
    #[error("the request already finished at {0}s")]
    AlreadyFinished(f64),
    #[error("{0:?} is not a valid Prometheus metric name")]
    InvalidMetricName(String),
    #[error("Prometheus metric {0:?} is exported twice")]
    DuplicateMetricName(String),
}

/// Speculation counters for one request or summed over many.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct SpecStats {
    /// Draft tokens sent to verification.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Steps with at least one draft.
    pub draft_steps: u64,
    /// `[i]` = draft steps whose draft `i` was accepted.
    pub accepted_per_position: Vec<u64>,
    /// `[i]` = draft steps that had a draft `i` at all.
    pub drafted_per_position: Vec<u64>,
    /// Decode/verify steps, one per request per step (prefill steps are not counted).
    pub forwards: u64,
    /// Tokens emitted by those steps: accepted drafts plus one each.
    pub tokens_generated_in_forwards: u64,
}

impl SpecStats {
    /// Records one decode/verify step of one request that emitted `accepted + 1` tokens.
    /// A step with `drafted == 0` is a plain decode: it counts as a forward, not as a draft step.
    pub fn record_step(&mut self, drafted: usize, accepted: usize) -> Result<(), MetricsError> {
        if accepted > drafted {
            return Err(MetricsError::AcceptedExceedsDrafted { drafted, accepted });
        }
        self.forwards += 1;
        self.tokens_generated_in_forwards += accepted as u64 + 1;
        if drafted == 0 {
            return Ok(());
        }
        self.draft_steps += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.grow_positions(drafted);
        for count in &mut self.drafted_per_position[..drafted] {
            *count += 1;
        }
        for count in &mut self.accepted_per_position[..accepted] {
            *count += 1;
        }
        Ok(())
    }

    /// Adds another set of counters to this one (for example a finished request into the totals).
    pub fn merge(&mut self, other: &SpecStats) {
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.draft_steps += other.draft_steps;
        self.forwards += other.forwards;
        self.tokens_generated_in_forwards += other.tokens_generated_in_forwards;
        self.grow_positions(other.drafted_per_position.len().max(other.accepted_per_position.len()));
        for (mine, theirs) in self.drafted_per_position.iter_mut().zip(&other.drafted_per_position) {
            *mine += theirs;
        }
        for (mine, theirs) in self.accepted_per_position.iter_mut().zip(&other.accepted_per_position) {
            *mine += theirs;
        }
    }

    /// Both per-position vectors always have the same length: the most drafts seen in one step.
    fn grow_positions(&mut self, positions: usize) {
        let len = positions.max(self.drafted_per_position.len()).max(self.accepted_per_position.len());
        self.drafted_per_position.resize(len, 0);
        self.accepted_per_position.resize(len, 0);
    }

    /// accepted / drafted; 0 when nothing was drafted.
    pub fn acceptance_rate(&self) -> f64 {
        ratio_or(self.accepted, self.drafted, 0.0)
    }

    /// 1 + accepted / draft_steps: tokens emitted per draft step, the bonus token included.
    /// 1 when no step drafted anything.
    pub fn mean_acceptance_length(&self) -> f64 {
        1.0 + ratio_or(self.accepted, self.draft_steps, 0.0)
    }

    /// `[i]` = fraction of draft steps whose draft `i` was accepted. Non-increasing in `i`, because a
    /// step that accepted draft `i + 1` also accepted draft `i`.
    pub fn per_position(&self) -> Vec<f64> {
        self.accepted_per_position.iter().map(|&count| ratio_or(count, self.draft_steps, 0.0)).collect()
    }

    /// Tokens emitted per decode/verify step over all such steps, those without drafts included.
    /// 0 when there were none.
    pub fn tokens_per_forward(&self) -> f64 {
        ratio_or(self.tokens_generated_in_forwards, self.forwards, 0.0)
    }

    /// Fraction of decode/verify steps that carried drafts.
    pub fn draft_step_fraction(&self) -> f64 {
        ratio_or(self.draft_steps, self.forwards, 0.0)
    }

    /// The `spec` object of `run --json`, `batch` and `bench`. `per_position` has at least `k` entries
    /// (positions never drafted show 0).
    pub fn to_json(&self, method: &str, k: usize) -> serde_json::Value {
        let mut per_position = self.per_position();
        if per_position.len() < k {
            per_position.resize(k, 0.0);
        }
        serde_json::json!({
            "method": method,
            "k": k,
            "draft_steps": self.draft_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate(),
            "mean_acceptance_length": self.mean_acceptance_length(),
            "per_position": per_position,
            "tokens_per_forward": self.tokens_per_forward(),
        })
    }
}

fn ratio_or(numerator: u64, denominator: u64, if_empty: f64) -> f64 {
    if denominator == 0 {
        if_empty
    } else {
        numerator as f64 / denominator as f64
    }
}

/// Seconds since a fixed origin, the time base of [`RequestTimeline`].
#[derive(Clone, Copy, Debug)]
pub struct SecondsClock {
    origin: Instant,
}

impl SecondsClock {
    pub fn start() -> Self {
        Self { origin: Instant::now() }
    }

    pub fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }
}

/// One streamed chunk: when it left and how many tokens it carried.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamedChunk {
    pub time: f64,
    pub tokens: usize,
}

/// The life of one request in seconds since a common origin.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestTimeline {
    arrival: f64,
    chunks: Vec<StreamedChunk>,
    finish: Option<f64>,
}

impl RequestTimeline {
    pub fn new(arrival: f64) -> Result<Self, MetricsError> {
        check_finite(arrival)?;
        Ok(Self { arrival, chunks: Vec::new(), finish: None })
    }

    /// Records a streamed chunk. Chunks without tokens carry nothing a client sees and are ignored.
    pub fn record_chunk(&mut self, time: f64, tokens: usize) -> Result<(), MetricsError> {
        self.check_next_time(time)?;
        if tokens > 0 {
            self.chunks.push(StreamedChunk { time, tokens });
        }
        Ok(())
    }

    /// Records the end of the request (the last chunk or the final event of the stream).
    pub fn finish(&mut self, time: f64) -> Result<(), MetricsError> {
        self.check_next_time(time)?;
        self.finish = Some(time);
        Ok(())
    }

    fn check_next_time(&self, time: f64) -> Result<(), MetricsError> {
        check_finite(time)?;
        if let Some(finished) = self.finish {
            return Err(MetricsError::AlreadyFinished(finished));
        }
        let previous = self.chunks.last().map_or(self.arrival, |chunk| chunk.time);
        if time < previous {
            return Err(MetricsError::TimeWentBackwards { time, previous });
        }
        Ok(())
    }

    pub fn chunks(&self) -> &[StreamedChunk] {
        &self.chunks
    }

    pub fn output_tokens(&self) -> usize {
        self.chunks.iter().map(|chunk| chunk.tokens).sum()
    }

    /// Arrival to the first chunk with tokens.
    pub fn ttft(&self) -> Option<f64> {
        self.chunks.first().map(|chunk| chunk.time - self.arrival)
    }

    /// Arrival to finish.
    pub fn e2e_latency(&self) -> Option<f64> {
        self.finish.map(|finish| finish - self.arrival)
    }

    /// `(e2e - ttft) / (output_tokens - 1)`; None until finished, or with fewer than two tokens
    /// (vLLM leaves such requests out of the TPOT statistics).
    pub fn tpot(&self) -> Option<f64> {
        let output_tokens = self.output_tokens();
        if output_tokens < 2 {
            return None;
        }
        Some((self.e2e_latency()? - self.ttft()?) / (output_tokens - 1) as f64)
    }

    /// Gaps between consecutive streamed chunks.
    pub fn itls(&self) -> Vec<f64> {
        self.chunks.windows(2).map(|pair| pair[1].time - pair[0].time).collect()
    }
}

fn check_finite(time: f64) -> Result<(), MetricsError> {
    if time.is_finite() {
        Ok(())
    } else {
        Err(MetricsError::NonFiniteTime(time))
    }
}

/// Mean, median and 99th percentile of a sample, in its own unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    pub mean: f64,
    pub median: f64,
    pub p99: f64,
}

/// Summary of `values`, percentiles interpolated linearly as numpy's default does. An empty sample
/// gives all zeros, as `vllm bench serve` reports it.
pub fn summarize(values: &[f64]) -> Summary {
    if values.is_empty() {
        return Summary::default();
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    Summary {
        mean: values.iter().sum::<f64>() / values.len() as f64,
        median: percentile_of_sorted(&sorted, 50.0),
        p99: percentile_of_sorted(&sorted, 99.0),
    }
}

/// The `q`-th percentile (0..=100) of ascending `sorted`: rank `q/100 * (n - 1)`, interpolated
/// between its neighbours. 0 for an empty slice.
pub fn percentile_of_sorted(sorted: &[f64], q: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return 0.0;
    };
    let rank = (q / 100.0).clamp(0.0, 1.0) * last as f64;
    let below = rank.floor() as usize;
    let above = rank.ceil() as usize;
    let fraction = rank - below as f64;
    sorted[below] + (sorted[above] - sorted[below]) * fraction
}

const ACCEPTED_PER_POSITION_TOTAL: &str = "kestrel_spec_accepted_per_position_total";

/// Reads one scalar speculation counter out of the stats.
type CounterField = fn(&SpecStats) -> u64;

/// The scalar speculation counters: name, help text, and the field each one exports.
const SPEC_COUNTERS: [(&str, &str, CounterField); 5] = [
    ("kestrel_spec_drafted_total", "Draft tokens sent to verification.", |stats| stats.drafted),
    ("kestrel_spec_accepted_total", "Draft tokens accepted by verification.", |stats| stats.accepted),
    ("kestrel_spec_draft_steps_total", "Decode steps of a request with at least one draft.", |stats| stats.draft_steps),
    ("kestrel_spec_forwards_total", "Decode and verify steps, one per request per step.", |stats| stats.forwards),
    ("kestrel_spec_forward_tokens_total", "Tokens emitted by decode and verify steps.", |stats| {
        stats.tokens_generated_in_forwards
    }),
];

/// Prometheus text exposition (format 0.0.4) of the speculation counters, followed by
/// `extra_gauges` given as `(name, help, value)`.
pub fn prometheus_text(stats: &SpecStats, extra_gauges: &[(&str, &str, f64)]) -> Result<String, MetricsError> {
    let mut names: Vec<&str> = SPEC_COUNTERS.iter().map(|&(name, _, _)| name).collect();
    names.push(ACCEPTED_PER_POSITION_TOTAL);
    for &(name, _, _) in extra_gauges {
        if !is_valid_metric_name(name) {
            return Err(MetricsError::InvalidMetricName(name.to_string()));
        }
        if names.contains(&name) {
            return Err(MetricsError::DuplicateMetricName(name.to_string()));
        }
        names.push(name);
    }

    let mut text = String::new();
    for (name, help, field) in SPEC_COUNTERS {
        write_header(&mut text, name, help, "counter");
        let _ = writeln!(text, "{name} {}", field(stats));
    }
    let help = "Draft steps whose draft at this position (0-based) was accepted.";
    write_header(&mut text, ACCEPTED_PER_POSITION_TOTAL, help, "counter");
    for (position, count) in stats.accepted_per_position.iter().enumerate() {
        let _ = writeln!(text, "{ACCEPTED_PER_POSITION_TOTAL}{{position=\"{position}\"}} {count}");
    }
    for &(name, help, value) in extra_gauges {
        write_header(&mut text, name, help, "gauge");
        let _ = writeln!(text, "{name} {}", prometheus_number(value));
    }
    Ok(text)
}

// Writing into a String cannot fail, so the fmt::Result of writeln! is dropped on purpose.
fn write_header(text: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(text, "# HELP {name} {}", escape_help(help));
    let _ = writeln!(text, "# TYPE {name} {kind}");
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`, the Prometheus metric name grammar.
fn is_valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    (first.is_ascii_alphabetic() || first == '_' || first == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// HELP text escapes only backslash and line feed.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

fn prometheus_number(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_string()
    } else if value == f64::INFINITY {
        "+Inf".to_string()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_string()
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn stats_from(steps: &[(usize, usize)]) -> SpecStats {
        let mut stats = SpecStats::default();
        for &(drafted, accepted) in steps {
            stats.record_step(drafted, accepted).expect("accepted <= drafted");
        }
        stats
    }

    /// `count` steps of at most `k` drafts each, with a random accepted prefix.
    fn random_steps(rng: &mut StdRng, count: usize, k: usize) -> Vec<(usize, usize)> {
        let mut step = || {
            let drafted = rng.random_range(0..=k);
            (drafted, rng.random_range(0..=drafted))
        };
        (0..count).map(|_| step()).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn hand_computed_example() {
        // Four steps with k = 3: (3 drafted, 2 accepted), (0, 0), (3, 3), (1, 0).
        let stats = stats_from(&[(3, 2), (0, 0), (3, 3), (1, 0)]);
        assert_eq!(stats.drafted, 7);
        assert_eq!(stats.accepted, 5);
        assert_eq!(stats.draft_steps, 3);
        assert_eq!(stats.forwards, 4);
        assert_eq!(stats.tokens_generated_in_forwards, 3 + 1 + 4 + 1);
        assert_eq!(stats.accepted_per_position, vec![2, 2, 1]);
        assert_eq!(stats.drafted_per_position, vec![3, 2, 2]);
        assert!(close(stats.acceptance_rate(), 5.0 / 7.0));
        assert!(close(stats.mean_acceptance_length(), 1.0 + 5.0 / 3.0));
        assert_eq!(stats.per_position(), vec![2.0 / 3.0, 2.0 / 3.0, 1.0 / 3.0]);
        assert!(close(stats.tokens_per_forward(), 9.0 / 4.0));
        assert!(close(stats.draft_step_fraction(), 0.75));

        // Exactly the keys of the `spec` contract; position 3 was never drafted.
        let expected = serde_json::json!({
            "method": "ngram", "k": 4, "draft_steps": 3, "drafted": 7, "accepted": 5,
            "acceptance_rate": 5.0 / 7.0, "mean_acceptance_length": 1.0 + 5.0 / 3.0,
            "per_position": [2.0 / 3.0, 2.0 / 3.0, 1.0 / 3.0, 0.0], "tokens_per_forward": 2.25,
        });
        assert_eq!(stats.to_json("ngram", 4), expected);
    }

    #[test]
    fn empty_stats_have_neutral_values() {
        let stats = SpecStats::default();
        assert_eq!(stats.acceptance_rate(), 0.0);
        assert_eq!(stats.mean_acceptance_length(), 1.0);
        assert!(stats.per_position().is_empty());
        assert_eq!(stats.tokens_per_forward(), 0.0);
        let plain_decoding = stats_from(&[(0, 0), (0, 0)]);
        assert_eq!(plain_decoding.mean_acceptance_length(), 1.0);
        assert_eq!(plain_decoding.tokens_per_forward(), 1.0);
        assert_eq!(plain_decoding.to_json("none", 0)["per_position"], serde_json::json!([]));
    }

    #[test]
    fn accepting_more_than_drafted_is_refused_and_records_nothing() {
        let mut stats = SpecStats::default();
        assert_eq!(stats.record_step(2, 3), Err(MetricsError::AcceptedExceedsDrafted { drafted: 2, accepted: 3 }));
        assert_eq!(stats, SpecStats::default());
    }

    #[test]
    fn invariants_hold_on_random_step_sequences() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        for _ in 0..200 {
            let k = rng.random_range(1..=8usize);
            let count = rng.random_range(0..100);
            let steps = random_steps(&mut rng, count, k);
            let stats = stats_from(&steps);
            assert!(stats.accepted <= stats.drafted);
            assert!(stats.draft_steps <= stats.forwards);
            assert_eq!(stats.accepted_per_position.iter().sum::<u64>(), stats.accepted);
            assert_eq!(stats.drafted_per_position.iter().sum::<u64>(), stats.drafted);
            let rates = stats.per_position();
            assert!(rates.iter().all(|&rate| (0.0..=1.0).contains(&rate)));
            assert!(rates.windows(2).all(|pair| pair[0] >= pair[1]), "{rates:?}");
            for (accepted, drafted) in stats.accepted_per_position.iter().zip(&stats.drafted_per_position) {
                assert!(accepted <= drafted);
            }
            assert!(stats.mean_acceptance_length() >= 1.0 && stats.mean_acceptance_length() <= 1.0 + k as f64);
            assert!(stats.tokens_per_forward() <= stats.mean_acceptance_length() || stats.draft_steps == 0);
            assert_eq!(stats.tokens_generated_in_forwards, stats.forwards + stats.accepted);
        }
    }

    #[test]
    fn merge_adds_up() {
        let mut rng = StdRng::seed_from_u64(3);
        let steps = random_steps(&mut rng, 300, 6);
        let whole = stats_from(&steps);
        let mut merged = SpecStats::default();
        for piece in steps.chunks(37) {
            merged.merge(&stats_from(piece));
        }
        assert_eq!(merged, whole);

        // Merging into something shorter extends the per-position vectors.
        let mut short = stats_from(&[(1, 1)]);
        short.merge(&stats_from(&[(4, 2)]));
        assert_eq!(short.accepted_per_position, vec![2, 1, 0, 0]);
        assert_eq!(short.drafted_per_position, vec![2, 1, 1, 1]);
    }

    #[test]
    fn timeline_latencies() {
        // Arrives at 10.0, first chunk 10.5 (1 token), then chunks of 3, 1 and 2 tokens, finishes 11.6.
        let mut timeline = RequestTimeline::new(10.0).expect("finite");
        timeline.record_chunk(10.5, 1).expect("in order");
        timeline.record_chunk(10.7, 3).expect("in order");
        timeline.record_chunk(10.7, 0).expect("ignored");
        timeline.record_chunk(11.0, 1).expect("in order");
        timeline.record_chunk(11.5, 2).expect("in order");
        timeline.finish(11.6).expect("in order");
        assert_eq!(timeline.output_tokens(), 7);
        assert!(close(timeline.ttft().expect("has a first token"), 0.5));
        assert!(close(timeline.e2e_latency().expect("finished"), 1.6));
        assert!(close(timeline.tpot().expect("several tokens"), (1.6 - 0.5) / 6.0));
        let gaps = timeline.itls();
        assert_eq!(gaps.len(), 3, "one gap per pair of chunks, not per token");
        assert!(gaps.iter().zip([0.2, 0.3, 0.5]).all(|(gap, expected)| (gap - expected).abs() < 1e-9), "{gaps:?}");
    }

    #[test]
    fn timeline_edge_cases() {
        let mut single = RequestTimeline::new(0.0).expect("finite");
        assert_eq!(single.ttft(), None);
        single.record_chunk(0.25, 1).expect("in order");
        assert_eq!(single.tpot(), None, "no TPOT before finishing");
        single.finish(0.25).expect("same time is fine");
        assert_eq!(single.tpot(), None, "one token has no TPOT");
        assert!(single.itls().is_empty());
        assert_eq!(single.record_chunk(0.3, 1), Err(MetricsError::AlreadyFinished(0.25)));

        let mut backwards = RequestTimeline::new(5.0).expect("finite");
        assert_eq!(backwards.record_chunk(4.0, 1), Err(MetricsError::TimeWentBackwards { time: 4.0, previous: 5.0 }));
        assert!(matches!(backwards.record_chunk(f64::NAN, 1), Err(MetricsError::NonFiniteTime(_))));
        assert!(RequestTimeline::new(f64::INFINITY).is_err());

        let clock = SecondsClock::start();
        let first = clock.now();
        assert!(first >= 0.0 && clock.now() >= first);
    }

    #[test]
    fn summary_matches_numpy() {
        // numpy.percentile([1, 2, 3, 4], 50) = 2.5; percentile(.., 99) = 3 + 0.97 = 3.97.
        let summary = summarize(&[4.0, 1.0, 3.0, 2.0]);
        assert!(close(summary.mean, 2.5));
        assert!(close(summary.median, 2.5));
        assert!(close(summary.p99, 3.97));
        // numpy.percentile(range(1, 102), 99) = 100.0 exactly (rank 99.0).
        let hundred_and_one: Vec<f64> = (1..=101).map(f64::from).collect();
        let summary = summarize(&hundred_and_one);
        assert!(close(summary.median, 51.0) && close(summary.p99, 100.0) && close(summary.mean, 51.0));
        // Odd count median and a single value.
        assert!(close(summarize(&[7.0, 1.0, 5.0]).median, 5.0));
        assert_eq!(summarize(&[2.0]), Summary { mean: 2.0, median: 2.0, p99: 2.0 });
        assert_eq!(summarize(&[]), Summary::default());
        assert!(close(percentile_of_sorted(&[0.0, 10.0], 25.0), 2.5));
        assert!(close(percentile_of_sorted(&[0.0, 10.0], 0.0), 0.0));
        assert!(close(percentile_of_sorted(&[0.0, 10.0], 100.0), 10.0));
    }

    #[test]
    fn prometheus_exposition() {
        let stats = stats_from(&[(3, 2), (0, 0), (2, 0)]);
        let text =
            prometheus_text(&stats, &[("kestrel_running_requests", "Requests\nin flight", 3.0)]).expect("valid names");
        let expected_lines = [
            "# HELP kestrel_spec_drafted_total Draft tokens sent to verification.",
            "# TYPE kestrel_spec_drafted_total counter",
            "kestrel_spec_drafted_total 5",
            "kestrel_spec_accepted_total 2",
            "kestrel_spec_draft_steps_total 2",
            "# TYPE kestrel_spec_accepted_per_position_total counter",
            "kestrel_spec_accepted_per_position_total{position=\"0\"} 1",
            "kestrel_spec_accepted_per_position_total{position=\"1\"} 1",
            "kestrel_spec_accepted_per_position_total{position=\"2\"} 0",
            "kestrel_spec_forwards_total 3",
            "kestrel_spec_forward_tokens_total 5",
            "# HELP kestrel_running_requests Requests\\nin flight",
            "# TYPE kestrel_running_requests gauge",
            "kestrel_running_requests 3",
        ];
        let lines: Vec<&str> = text.lines().collect();
        for expected in expected_lines {
            assert!(lines.contains(&expected), "missing {expected:?} in\n{text}");
        }
        assert!(text.ends_with('\n'));
        // Every sample line belongs to a declared metric.
        for line in lines.iter().filter(|line| !line.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(text.contains(&format!("# TYPE {name} ")), "undeclared sample {line:?}");
        }
    }

    #[test]
    fn prometheus_refuses_bad_gauges_and_formats_special_values() {
        let stats = SpecStats::default();
        assert_eq!(
            prometheus_text(&stats, &[("9lives", "", 1.0)]),
            Err(MetricsError::InvalidMetricName("9lives".to_string()))
        );
        assert!(prometheus_text(&stats, &[("has space", "", 1.0)]).is_err());
        assert!(prometheus_text(&stats, &[("", "", 1.0)]).is_err());
        assert_eq!(
            prometheus_text(&stats, &[("kestrel_spec_drafted_total", "", 1.0)]),
            Err(MetricsError::DuplicateMetricName("kestrel_spec_drafted_total".to_string()))
        );
        let text = prometheus_text(&stats, &[("a", "", f64::NAN), ("b:c", "", f64::INFINITY), ("_d", "", -0.5)])
            .expect("valid names");
        assert!(text.contains("\na NaN\n") && text.contains("\nb:c +Inf\n") && text.contains("\n_d -0.5\n"));
    }
}
