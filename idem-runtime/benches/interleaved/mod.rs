//! Ratios that hold on a busy machine: ours and the baseline measured in alternating batches
//! of one loop, so that load drifting during the run lands on both sides of every ratio.
//!
//! Criterion measures one function after the other; a build that starts between them moves
//! the ratio by 30 % and more. Here each batch of ours is paired with the batch of the
//! baseline next to it (which one goes first alternates), and the result is the median of
//! those per-pair ratios, with the 10th and 90th percentiles as its spread.

use std::future::Future;
use std::hint::black_box;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

/// One side of a path: runs the path `iters` times and returns how long that took.
pub trait Side: FnMut(u64) -> Duration {}

impl<F: FnMut(u64) -> Duration> Side for F {}

/// How long one batch of either side should take: long enough that timer resolution and
/// a single scheduler hiccup are small against it, short enough that load changes little
/// within one pair of batches.
const BATCH: Duration = Duration::from_millis(4);
/// The fewest pairs of batches a ratio is taken from, however long they take.
const MIN_PAIRS: usize = 21;

/// The interleaved measurement of one path.
#[derive(Clone, Copy, Debug)]
pub struct Ratio {
    /// The median of the per-pair ratios (ours / baseline).
    pub median: f64,
    /// The 10th percentile of the per-pair ratios.
    pub low: f64,
    /// The 90th percentile of the per-pair ratios.
    pub high: f64,
    /// How many pairs of batches were measured.
    pub pairs: usize,
    /// Mean time of one call of ours, over every batch.
    pub ours: Duration,
    /// Mean time of one call of the baseline, over every batch.
    pub baseline: Duration,
}

/// Measures `ours` against `baseline` for about `budget` (after a calibration that also
/// warms both up).
pub fn measure(ours: &mut impl Side, baseline: &mut impl Side, budget: Duration) -> Ratio {
    // Each side gets its own batch size, so that both batches of a pair take about `BATCH`:
    // a preemption then is as likely to land in ours as in the baseline's, and the ratios
    // spread evenly around the true one instead of leaning towards the slower side.
    let ours_iters = calibrate(ours);
    let baseline_iters = calibrate(baseline);
    let started = Instant::now();
    let mut ratios = Vec::new();
    let (mut ours_total, mut baseline_total) = (Duration::ZERO, Duration::ZERO);
    while ratios.len() < MIN_PAIRS || started.elapsed() < budget {
        let (o, b) = if ratios.len() % 2 == 0 {
            let o = ours(ours_iters);
            (o, baseline(baseline_iters))
        } else {
            let b = baseline(baseline_iters);
            (ours(ours_iters), b)
        };
        ours_total += o;
        baseline_total += b;
        let per_call = |t: Duration, iters: u64| t.as_secs_f64() / iters as f64;
        ratios.push(per_call(o, ours_iters) / per_call(b, baseline_iters).max(1e-15));
    }
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    let mean = |total: Duration, iters: u64| {
        Duration::from_secs_f64(total.as_secs_f64() / (iters * ratios.len() as u64) as f64)
    };
    Ratio {
        median: at(0.5),
        low: at(0.1),
        high: at(0.9),
        pairs: ratios.len(),
        ours: mean(ours_total, ours_iters),
        baseline: mean(baseline_total, baseline_iters),
    }
}

/// The batch size at which `side` takes `BATCH`: doubled until it does, judged by the
/// quickest of three tries so that one stall does not stop the doubling early.
fn calibrate(side: &mut impl Side) -> u64 {
    let mut iters = 1_u64;
    while iters < 1 << 24 && (0..3).map(|_| side(iters)).min().unwrap_or_default() < BATCH {
        iters *= 2;
    }
    iters
}

/// A side that awaits `call` once per iteration, on `rt`.
#[allow(dead_code)] // benches without an async path
pub fn on<'a, F, Fut>(rt: &'a Runtime, mut call: F) -> impl Side + 'a
where
    F: FnMut() -> Fut + 'a,
    Fut: Future,
{
    move |iters| {
        rt.block_on(async {
            let started = Instant::now();
            for _ in 0..iters {
                black_box(call().await);
            }
            started.elapsed()
        })
    }
}
