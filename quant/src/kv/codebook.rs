//! The Lloyd-Max codebook of a rotated unit vector's coordinates (TurboQuant).
//!
//! After a random rotation, each coordinate `t` of a unit vector in `d` dimensions follows the
//! density `f(t) ∝ (1 - t²)^((d - 3) / 2)` on [-1, 1] (close to N(0, 1/d) for large d), and the
//! coordinates are nearly independent. The best scalar quantizer of that density (least mean
//! squared error) is the Lloyd-Max codebook: each level is the conditional mean of its cell, and
//! cells meet halfway between levels. It is computed here for the exact density of the head
//! dimension, once per cache, in f64, so the CPU and every device read the same f32 table.

/// Levels of a 3-bit code.
pub const LEVELS: usize = 8;

/// A symmetric 3-bit Lloyd-Max codebook for unit vectors of one dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    /// Levels in increasing order; `centroids[7 - k] == -centroids[k]`.
    pub centroids: [f32; LEVELS],
    /// Cell boundaries, halfway between neighbouring levels: code `k` holds the values with
    /// exactly `k` boundaries strictly below them.
    pub boundaries: [f32; LEVELS - 1],
    /// Mean squared error of the codebook on one unit vector (the per-coordinate error times
    /// `d`), from the density: what quantizing a random unit vector costs on average.
    pub unit_mse: f64,
}

/// Intervals of the integration grid over [-1, 1].
const GRID: usize = 1 << 16;
/// Largest Lloyd-Max iteration count; the levels settle far sooner.
const MAX_ITERATIONS: usize = 20_000;

/// Centroids of the 3-bit Lloyd-Max quantizer of N(0, 1): a starting point, scaled by 1/√d.
const GAUSSIAN_LEVELS: [f64; 4] = [0.2451, 0.7560, 1.3440, 2.1520];

/// Cumulative integrals of the density and of `t` times the density over a uniform grid, so that
/// the mass and first moment of any cell are two differences.
struct Moments {
    step: f64,
    mass: Vec<f64>,
    first: Vec<f64>,
}

impl Moments {
    fn new(dim: usize) -> Moments {
        let power = (dim as f64 - 3.0) / 2.0;
        let step = 2.0 / GRID as f64;
        let density = |t: f64| {
            let r = 1.0 - t * t;
            if r <= 0.0 {
                0.0
            } else {
                (power * r.ln()).exp()
            }
        };
        let (mut mass, mut first) = (Vec::with_capacity(GRID + 1), Vec::with_capacity(GRID + 1));
        let (mut m, mut f) = (0.0f64, 0.0f64);
        let (mut prev_t, mut prev_d) = (-1.0f64, density(-1.0));
        mass.push(0.0);
        first.push(0.0);
        for i in 1..=GRID {
            let t = -1.0 + step * i as f64;
            let d = density(t);
            m += 0.5 * step * (prev_d + d);
            f += 0.5 * step * (prev_t * prev_d + t * d);
            mass.push(m);
            first.push(f);
            (prev_t, prev_d) = (t, d);
        }
        Moments { step, mass, first }
    }

    /// (mass, first moment) from -1 to `t`, linear between grid points.
    fn below(&self, t: f64) -> (f64, f64) {
        let x = ((t + 1.0) / self.step).clamp(0.0, GRID as f64);
        let i = (x.floor() as usize).min(GRID - 1);
        let frac = x - i as f64;
        let lerp = |v: &[f64]| v[i] + frac * (v[i + 1] - v[i]);
        (lerp(&self.mass), lerp(&self.first))
    }

    /// Mass and first moment of the cell (a, b].
    fn cell(&self, a: f64, b: f64) -> (f64, f64) {
        let (ma, fa) = self.below(a);
        let (mb, fb) = self.below(b);
        (mb - ma, fb - fa)
    }
}

impl Codebook {
    /// The codebook for unit vectors of `dim` coordinates (`dim` at least 3, where the density
    /// is bounded).
    pub fn lloyd_max(dim: usize) -> Codebook {
        assert!(dim >= 3, "the rotated-coordinate density needs at least 3 dimensions");
        let moments = Moments::new(dim);
        let sigma = 1.0 / (dim as f64).sqrt();
        // Levels start at the Gaussian ones and stay symmetric: only the upper four move.
        let mut upper: [f64; 4] = GAUSSIAN_LEVELS.map(|c| (c * sigma).min(0.99));
        for _ in 0..MAX_ITERATIONS {
            let mut next = upper;
            for k in 0..4 {
                let lo = if k == 0 { 0.0 } else { 0.5 * (upper[k - 1] + upper[k]) };
                let hi = if k == 3 { 1.0 } else { 0.5 * (upper[k] + upper[k + 1]) };
                let (mass, first) = moments.cell(lo, hi);
                if mass > 0.0 {
                    next[k] = first / mass;
                }
            }
            let moved = next.iter().zip(&upper).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            upper = next;
            if moved < 1e-15 {
                break;
            }
        }
        let levels: [f64; LEVELS] = std::array::from_fn(|k| if k < 4 { -upper[3 - k] } else { upper[k - 4] });
        let unit_mse = Self::mse(&moments, &levels) * dim as f64;
        Codebook {
            centroids: levels.map(|c| c as f32),
            boundaries: std::array::from_fn(|k| (0.5 * (levels[k] + levels[k + 1])) as f32),
            unit_mse,
        }
    }

    /// Mean squared error per coordinate of `levels` under the density: the sum over cells of
    /// ∫ (t - c)² f / ∫ f over [-1, 1], on the grid.
    fn mse(moments: &Moments, levels: &[f64; LEVELS]) -> f64 {
        let total = moments.mass[GRID];
        let (mut err, mut t) = (0.0f64, -1.0f64);
        let step = moments.step;
        // Second moments are not kept: each grid interval's mass times the squared distance of
        // its midpoint to its level.
        for i in 0..GRID {
            let mid = t + 0.5 * step;
            let k = levels.windows(2).filter(|w| 0.5 * (w[0] + w[1]) < mid).count();
            let d = mid - levels[k];
            err += d * d * (moments.mass[i + 1] - moments.mass[i]);
            t += step;
        }
        err / total
    }

    /// The code of one coordinate of a unit vector: how many boundaries lie strictly below it.
    #[inline(always)]
    pub fn code(&self, u: f32) -> u8 {
        self.boundaries.iter().map(|&b| u8::from(u > b)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For large d the density is nearly N(0, 1/d), whose 3-bit Lloyd-Max levels are published
    /// (the TurboQuant paper's table): the exact-density levels times √d lie within 1% of them.
    #[test]
    fn levels_approach_the_gaussian_lloyd_max_levels() {
        for dim in [128usize, 256, 512] {
            let cb = Codebook::lloyd_max(dim);
            let scaled: Vec<f64> = cb.centroids[4..].iter().map(|&c| c as f64 * (dim as f64).sqrt()).collect();
            for (got, want) in scaled.iter().zip(GAUSSIAN_LEVELS) {
                assert!((got / want - 1.0).abs() < 0.01, "d {dim}: level {got} vs Gaussian {want}");
            }
        }
    }

    /// Each level is the conditional mean of its cell (the Lloyd-Max fixed point), the cells
    /// meet halfway, and the codebook is symmetric.
    #[test]
    fn levels_are_the_means_of_their_cells() {
        for dim in [8usize, 16, 64, 256] {
            let cb = Codebook::lloyd_max(dim);
            let moments = Moments::new(dim);
            for k in 0..LEVELS {
                assert_eq!(cb.centroids[k], -cb.centroids[LEVELS - 1 - k], "d {dim}: not symmetric");
                let lo = if k == 0 { -1.0 } else { cb.boundaries[k - 1] as f64 };
                let hi = if k == LEVELS - 1 { 1.0 } else { cb.boundaries[k] as f64 };
                let (mass, first) = moments.cell(lo, hi);
                let mean = first / mass;
                assert!((mean - cb.centroids[k] as f64).abs() < 1e-5 * (cb.centroids[7] as f64), "d {dim}: level {k} {} vs cell mean {mean}", cb.centroids[k]);
            }
            for k in 0..LEVELS - 1 {
                assert!(cb.centroids[k] < cb.boundaries[k] && cb.boundaries[k] < cb.centroids[k + 1], "d {dim}: boundary {k} out of order");
            }
        }
    }

    /// The paper's refined distortion for 3 bits is about 0.03 (the Gaussian Lloyd-Max value
    /// 0.0345), below Theorem 1's bound √3·π/2·4⁻³ and above the lower bound 4⁻³ of any
    /// quantizer.
    #[test]
    fn distortion_matches_the_paper() {
        for dim in [64usize, 128, 256] {
            let mse = Codebook::lloyd_max(dim).unit_mse;
            let upper = 3f64.sqrt() * std::f64::consts::PI / 2.0 / 64.0;
            assert!(mse < upper && mse > 1.0 / 64.0, "d {dim}: distortion {mse}");
            assert!((mse - 0.0345).abs() < 0.002, "d {dim}: distortion {mse} vs 0.0345");
        }
    }

    #[test]
    fn codes_count_the_boundaries_below() {
        let cb = Codebook::lloyd_max(64);
        assert_eq!(cb.code(-1.0), 0);
        assert_eq!(cb.code(1.0), 7);
        for k in 0..LEVELS {
            assert_eq!(cb.code(cb.centroids[k]), k as u8);
        }
        // A value on a boundary goes to the lower cell.
        assert_eq!(cb.code(cb.boundaries[3]), 3);
    }
}
