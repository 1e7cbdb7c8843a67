//! The fixed randomized Hadamard rotation of a head vector (TurboQuant's Π).
//!
//! `rotate(x) = H·(s ⊙ x) / √d`, with `H` the Sylvester Hadamard matrix of order `d` (a power of
//! two) and `s` a fixed vector of random signs; `H·H = d·I`, so `unrotate(y) = s ⊙ (H·y) / √d`
//! is its inverse and transpose. The product by `H` is the fast Walsh-Hadamard transform, whose
//! every output of a stage is one sum or difference of two inputs of the stage before: a device
//! that runs the same stages gets the same bits.

use super::KvFormatError;

/// Seed of the sign vector: one fixed rotation for every layer, head, key and value.
pub const SIGN_SEED: u64 = 0x5475_7262_6f51_3342;

#[derive(Debug, Clone, PartialEq)]
pub struct RandomizedHadamard {
    signs: Vec<f32>,
    scale: f32,
}

/// The fast Walsh-Hadamard transform in Sylvester order: stages of pair distance 1, 2, 4, ...,
/// each pair (a, b) becoming (a + b, a - b).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// splitmix64: the sign stream.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl RandomizedHadamard {
    pub fn new(dim: usize) -> Result<RandomizedHadamard, KvFormatError> {
        if !dim.is_power_of_two() || dim < 8 {
            return Err(KvFormatError::HeadDim { dim, need: "a power of two, at least 8" });
        }
        let mut state = SIGN_SEED;
        let signs = (0..dim).map(|_| if splitmix64(&mut state) >> 63 == 0 { 1.0 } else { -1.0 }).collect();
        Ok(RandomizedHadamard { signs, scale: (1.0 / (dim as f64).sqrt()) as f32 })
    }

    pub fn dim(&self) -> usize {
        self.signs.len()
    }

    /// The ±1 signs `s`.
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    /// `1 / √d` in f32.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// `x ← H·(s ⊙ x) / √d`.
    pub fn rotate(&self, x: &mut [f32]) {
        assert_eq!(x.len(), self.dim(), "rotation of a vector of another dimension");
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht(x);
        for v in x.iter_mut() {
            *v *= self.scale;
        }
    }

    /// `y ← s ⊙ (H·y) / √d`, the inverse of [`RandomizedHadamard::rotate`].
    pub fn unrotate(&self, y: &mut [f32]) {
        assert_eq!(y.len(), self.dim(), "rotation of a vector of another dimension");
        fwht(y);
        for (v, s) in y.iter_mut().zip(&self.signs) {
            *v = *v * self.scale * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vector(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n).map(|_| (splitmix64(&mut s) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect()
    }

    /// The rotation's columns are orthonormal: rotating the unit vectors gives vectors of
    /// length 1 that are pairwise orthogonal.
    #[test]
    fn rotation_is_orthogonal() {
        for dim in [8usize, 64, 256] {
            let r = RandomizedHadamard::new(dim).unwrap();
            let cols: Vec<Vec<f32>> = (0..dim)
                .map(|i| {
                    let mut e = vec![0.0f32; dim];
                    e[i] = 1.0;
                    r.rotate(&mut e);
                    e
                })
                .collect();
            for i in 0..dim {
                for j in 0..dim {
                    let dot: f64 = cols[i].iter().zip(&cols[j]).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-6, "d {dim}: column {i} . column {j} = {dot}");
                }
            }
        }
    }

    /// `unrotate` inverts `rotate` (to rounding) and the rotation keeps lengths and inner
    /// products.
    #[test]
    fn unrotate_inverts_rotate_and_inner_products_survive() {
        for dim in [8usize, 64, 256] {
            let r = RandomizedHadamard::new(dim).unwrap();
            let (x, q) = (vector(1, dim), vector(2, dim));
            let (mut y, mut qy) = (x.clone(), q.clone());
            r.rotate(&mut y);
            r.rotate(&mut qy);
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
            assert!((dot(&x, &q) - dot(&y, &qy)).abs() < 1e-4, "d {dim}: inner product changed");
            let mut back = y.clone();
            r.unrotate(&mut back);
            for (a, b) in back.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5, "d {dim}: {a} vs {b}");
            }
        }
    }

    /// The signs are a real mix (a rotation without them would be plain Hadamard), and fixed.
    #[test]
    fn signs_are_mixed_and_fixed() {
        let r = RandomizedHadamard::new(256).unwrap();
        let negative = r.signs().iter().filter(|&&s| s < 0.0).count();
        assert!((96..160).contains(&negative), "{negative} negative signs of 256");
        assert_eq!(r, RandomizedHadamard::new(256).unwrap());
        assert_eq!(r.signs()[..64], RandomizedHadamard::new(64).unwrap().signs()[..], "a shorter rotation takes the first signs");
    }

    #[test]
    fn dimensions_that_are_not_powers_of_two_are_refused() {
        for dim in [0usize, 4, 12, 96, 255] {
            let err = RandomizedHadamard::new(dim).unwrap_err().to_string();
            assert!(err.contains(&dim.to_string()) && err.contains("power of two"), "{err}");
        }
    }
}
