//! A fixed-size log-linear histogram of latencies, like HdrHistogram with
//! two significant digits: values below 128 are exact, larger ones land in
//! one of 64 buckets per power of two (at most 1/64 above the true value).
//! Memory stays a few KiB however many samples a run at full speed takes.

/// Values below this have a bucket each.
const EXACT: u64 = 128;
/// Buckets per power of two above [`EXACT`].
const PER_OCTAVE: u64 = EXACT / 2;

#[derive(Clone, Debug, Default)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Histogram {
    pub fn record(&mut self, value: u64) {
        let index = bucket(value);
        if index >= self.counts.len() {
            self.counts.resize(index + 1, 0);
        }
        self.counts[index] += 1;
        self.total += 1;
        self.max = self.max.max(value);
    }

    pub fn merge(&mut self, other: &Histogram) {
        if other.counts.len() > self.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The value at or below which `quantile` (0..=1) of the samples lie,
    /// rounded up to its bucket's upper bound; `None` without samples.
    pub fn quantile(&self, quantile: f64) -> Option<u64> {
        let rank = ((quantile * self.total as f64).ceil() as u64).clamp(1, self.total.max(1));
        let mut seen = 0;
        self.counts.iter().enumerate().find_map(|(index, count)| {
            seen += count;
            (seen >= rank).then(|| upper_bound(index).min(self.max))
        })
    }
}

fn bucket(value: u64) -> usize {
    if value < EXACT {
        return value as usize;
    }
    // Keep the 7 leading bits: `value >> shift` lies in 64..128.
    let shift = u64::from(63 - value.leading_zeros()) - 6;
    (shift * PER_OCTAVE + (value >> shift)) as usize
}

fn upper_bound(index: usize) -> u64 {
    let index = index as u64;
    if index < EXACT {
        return index;
    }
    let shift = index / PER_OCTAVE - 1;
    let leading = index - shift * PER_OCTAVE;
    (leading << shift) + ((1 << shift) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(values: impl IntoIterator<Item = u64>) -> Histogram {
        let mut histogram = Histogram::default();
        for value in values {
            histogram.record(value);
        }
        histogram
    }

    #[test]
    fn small_values_give_exact_percentiles() {
        let histogram = of(1..=100);
        assert_eq!(histogram.quantile(0.5), Some(50));
        assert_eq!(histogram.quantile(0.99), Some(99));
        assert_eq!(histogram.quantile(1.0), Some(100));
        assert_eq!(histogram.quantile(0.0), Some(1));
        assert_eq!(histogram.count(), 100);
    }

    #[test]
    fn large_values_are_within_one_bucket_above() {
        let histogram = of((1..=100_000).rev());
        for (quantile, exact) in [(0.5, 50_000.0), (0.99, 99_000.0), (0.999, 99_900.0)] {
            let found = histogram.quantile(quantile).unwrap() as f64;
            assert!(
                found >= exact && found <= exact * (1.0 + 1.0 / 64.0),
                "p{quantile}: {found} for {exact}"
            );
        }
        assert_eq!(histogram.quantile(1.0), Some(100_000));
    }

    #[test]
    fn every_value_falls_in_the_bucket_that_bounds_it() {
        for value in (0..5_000).chain([u64::from(u32::MAX), u64::MAX]) {
            let index = bucket(value);
            assert!(upper_bound(index) >= value, "{value}");
            assert!(index == 0 || upper_bound(index - 1) < value, "{value}");
        }
    }

    #[test]
    fn merging_equals_recording_everything_in_one() {
        let mut merged = of([3, 900, 70_000]);
        merged.merge(&of([5, 1_000_000]));
        let together = of([3, 900, 70_000, 5, 1_000_000]);
        for quantile in [0.2, 0.5, 0.8, 1.0] {
            assert_eq!(merged.quantile(quantile), together.quantile(quantile));
        }
        assert_eq!(merged.count(), 5);
    }

    #[test]
    fn no_samples_no_percentile() {
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
