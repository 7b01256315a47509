//! The sequencer of one task: which fetched offsets are completed, the
//! watermark (the completed prefix), and, in `offset` order, the completed
//! ranges held back until every earlier range is done. Bounded by the caller:
//! `in_flight()` is what the task may not let grow past `max_in_flight_records`.

use std::collections::{BTreeMap, VecDeque};

pub(crate) struct Sequencer<B> {
    /// Every offset below is completed.
    watermark: u64,
    /// Completion flags of offsets `[watermark, watermark + done.len())`.
    done: VecDeque<bool>,
    /// `offset` order: completed ranges by first offset, not yet released.
    held: BTreeMap<u64, (u64, B)>,
    /// `offset` order: the first offset not yet released.
    next_release: u64,
}

impl<B> Sequencer<B> {
    pub(crate) fn new(start: u64) -> Self {
        Sequencer {
            watermark: start,
            done: VecDeque::new(),
            held: BTreeMap::new(),
            next_release: start,
        }
    }

    pub(crate) fn watermark(&self) -> u64 {
        self.watermark
    }

    /// The next offset to fetch.
    pub(crate) fn fetched_end(&self) -> u64 {
        self.watermark + self.done.len() as u64
    }

    /// Fetched and not yet part of the completed prefix.
    pub(crate) fn in_flight(&self) -> usize {
        self.done.len()
    }

    /// Completed offsets above the watermark (completion out of order).
    pub(crate) fn completed_above(&self) -> Vec<u64> {
        self.done
            .iter()
            .enumerate()
            .filter(|(_, done)| **done)
            .map(|(i, _)| self.watermark + i as u64)
            .collect()
    }

    /// Records `count` more offsets as fetched (from `fetched_end()` on).
    pub(crate) fn fetched(&mut self, count: usize) {
        self.done.extend(std::iter::repeat_n(false, count));
    }

    fn mark(&mut self, offset: u64) {
        let index = offset
            .checked_sub(self.watermark)
            .map(|i| i as usize)
            .filter(|&i| i < self.done.len());
        match index {
            Some(i) => {
                debug_assert!(!self.done[i], "offset {offset} completed twice");
                self.done[i] = true;
            }
            None => debug_assert!(false, "offset {offset} was never fetched"),
        }
    }

    fn advance(&mut self) {
        while self.done.front() == Some(&true) {
            self.done.pop_front();
            self.watermark += 1;
        }
    }

    /// Completes the contiguous range `first..=last` and appends what may be
    /// released now to `released`: in order (`ordered`), every held range
    /// that has become the next one; otherwise this range at once.
    pub(crate) fn complete_range(
        &mut self,
        first: u64,
        last: u64,
        batch: B,
        ordered: bool,
        released: &mut Vec<B>,
    ) {
        for offset in first..=last {
            self.mark(offset);
        }
        self.advance();
        if !ordered {
            released.push(batch);
            return;
        }
        self.held.insert(first, (last, batch));
        while let Some(entry) = self.held.first_entry() {
            if *entry.key() != self.next_release {
                break;
            }
            let (last, batch) = entry.remove();
            self.next_release = last + 1;
            released.push(batch);
        }
    }

    /// Completes scattered offsets (`key` order) and releases the batch at once.
    pub(crate) fn complete_offsets(
        &mut self,
        offsets: impl IntoIterator<Item = u64>,
        batch: B,
        released: &mut Vec<B>,
    ) {
        for offset in offsets {
            self.mark(offset);
        }
        self.advance();
        released.push(batch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Cuts `0..total` into ranges of the given sizes.
    fn ranges(total: u64, sizes: &[u64]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut first = 0;
        let mut i = 0;
        while first < total {
            let size = sizes[i % sizes.len()].max(1);
            let last = (first + size - 1).min(total - 1);
            out.push((first, last));
            first = last + 1;
            i += 1;
        }
        out
    }

    /// Applies a permutation given by sort keys.
    fn permuted<T: Clone>(items: &[T], keys: &[u32]) -> Vec<T> {
        let mut indexed: Vec<(u32, usize)> = (0..items.len()).map(|i| (keys[i % keys.len()], i)).collect();
        indexed.sort();
        indexed.into_iter().map(|(_, i)| items[i].clone()).collect()
    }

    proptest! {
        /// In `offset` order, any completion order releases ranges in strictly
        /// increasing offsets with no gap and no duplicate, and the watermark is
        /// exactly the completed prefix after every step.
        #[test]
        fn offset_order_releases_in_order_and_watermark_is_the_completed_prefix(
            total in 1u64..400,
            sizes in proptest::collection::vec(1u64..40, 1..10),
            keys in proptest::collection::vec(any::<u32>(), 1..64),
            fetch_steps in proptest::collection::vec(1usize..100, 1..8),
        ) {
            let ranges = ranges(total, &sizes);
            let order = permuted(&ranges, &keys);
            let mut seq = Sequencer::new(0);
            let mut completed = vec![false; total as usize];
            let mut delivered: Vec<u64> = Vec::new();
            // Fetch in uneven steps, interleaved with completions.
            let mut fetch_steps = fetch_steps.into_iter().cycle();
            let mut next = order.into_iter().peekable();
            while let Some(&(first, last)) = next.peek() {
                if seq.fetched_end() <= last {
                    let step = fetch_steps.next().unwrap().min((total - seq.fetched_end()) as usize);
                    seq.fetched(step);
                    continue;
                }
                next.next();
                let mut released = Vec::new();
                seq.complete_range(first, last, (first, last), true, &mut released);
                for (f, l) in released {
                    delivered.extend(f..=l);
                }
                for o in first..=last {
                    completed[o as usize] = true;
                }
                let prefix = completed.iter().take_while(|&&c| c).count() as u64;
                prop_assert_eq!(seq.watermark(), prefix);
                prop_assert_eq!(delivered.len() as u64, prefix, "delivered exactly the prefix");
            }
            prop_assert_eq!(delivered, (0..total).collect::<Vec<_>>());
            prop_assert_eq!(seq.in_flight(), 0);
        }

        /// Without order, every range is released exactly once on completion and
        /// the watermark is still exactly the completed prefix.
        #[test]
        fn unordered_releases_every_record_exactly_once(
            total in 1u64..300,
            sizes in proptest::collection::vec(1u64..30, 1..10),
            keys in proptest::collection::vec(any::<u32>(), 1..64),
        ) {
            let ranges = ranges(total, &sizes);
            let mut seq = Sequencer::new(1000);
            seq.fetched(total as usize);
            let mut seen = vec![0u32; total as usize];
            let mut completed = vec![false; total as usize];
            for (first, last) in permuted(&ranges, &keys) {
                let mut released = Vec::new();
                seq.complete_range(first + 1000, last + 1000, (first, last), false, &mut released);
                prop_assert_eq!(released.len(), 1);
                for (f, l) in released {
                    for o in f..=l { seen[o as usize] += 1; completed[o as usize] = true; }
                }
                let prefix = completed.iter().take_while(|&&c| c).count() as u64;
                prop_assert_eq!(seq.watermark(), 1000 + prefix);
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
        }

        /// Scattered completions (`key` order units) keep the watermark at the prefix.
        #[test]
        fn scattered_completions_keep_the_watermark_at_the_prefix(
            total in 1usize..300,
            lanes in 1usize..8,
            keys in proptest::collection::vec(any::<u32>(), 1..64),
        ) {
            let mut seq = Sequencer::new(0);
            seq.fetched(total);
            let units: Vec<Vec<u64>> = (0..lanes)
                .map(|lane| (0..total as u64).filter(|o| (*o as usize) % lanes == lane).collect())
                .filter(|u: &Vec<u64>| !u.is_empty())
                .collect();
            let mut completed = vec![false; total];
            for unit in permuted(&units, &keys) {
                let mut released = Vec::new();
                seq.complete_offsets(unit.iter().copied(), (), &mut released);
                for o in &unit { completed[*o as usize] = true; }
                let prefix = completed.iter().take_while(|&&c| c).count() as u64;
                prop_assert_eq!(seq.watermark(), prefix);
            }
            prop_assert_eq!(seq.watermark(), total as u64);
        }
    }
}
