//! The sequencer of one task (or of one retry-topic partition): which fetched
//! offsets are completed, the watermark (the completed prefix, what a commit
//! records) and, where outcomes must be released in offset order while several
//! threads complete records out of order, the outcomes held until every
//! earlier record is done.
//!
//! Invariants: `watermark + span()` is the fetch position; every offset below
//! the watermark completed exactly once; a held value is released exactly
//! once, in offset order, when the watermark passes it. Cost: O(1) amortized
//! per fetched and per completed offset; one slot of memory per offset of the
//! span (fetched, not yet below the watermark), which the task bounds.

use std::collections::VecDeque;

enum Slot<T> {
    Pending,
    Done,
    /// Completed; the value is released when the watermark passes it.
    Held(T),
}

pub(crate) struct Sequencer<T> {
    /// Every offset below is completed.
    watermark: u64,
    /// Offsets `[watermark, watermark + slots.len())`; the front is always `Pending`.
    slots: VecDeque<Slot<T>>,
    /// Slots still `Pending`.
    pending: usize,
}

impl<T> Sequencer<T> {
    pub(crate) fn new(start: u64) -> Self {
        Sequencer {
            watermark: start,
            slots: VecDeque::new(),
            pending: 0,
        }
    }

    pub(crate) fn watermark(&self) -> u64 {
        self.watermark
    }

    /// The next offset to fetch.
    pub(crate) fn fetched_end(&self) -> u64 {
        self.watermark + self.slots.len() as u64
    }

    /// Offsets fetched and not yet below the watermark (completed ones included).
    pub(crate) fn span(&self) -> usize {
        self.slots.len()
    }

    /// Offsets fetched and not completed.
    pub(crate) fn pending(&self) -> usize {
        self.pending
    }

    /// Whether `offset` has completed (below the watermark or completed above it).
    pub(crate) fn is_completed(&self, offset: u64) -> bool {
        match offset.checked_sub(self.watermark) {
            None => true,
            Some(i) => self
                .slots
                .get(i as usize)
                .is_some_and(|slot| !matches!(slot, Slot::Pending)),
        }
    }

    /// Completed offsets above the watermark (completion out of order).
    pub(crate) fn completed_above(&self) -> Vec<u64> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| !matches!(slot, Slot::Pending))
            .map(|(i, _)| self.watermark + i as u64)
            .collect()
    }

    /// Records `count` more offsets as fetched (from `fetched_end()` on), all
    /// records: `fetched_at` without gaps, for tests.
    #[cfg(test)]
    pub(crate) fn fetched(&mut self, count: usize) {
        let end = self.fetched_end();
        self.fetched_at(end..end + count as u64);
    }

    /// Records fetched records at `offsets` (ascending, from `fetched_end()`
    /// on). An offset skipped on the way holds no record at all (a Kafka
    /// transaction marker, a record compacted away): it is a gap, completed
    /// at once, so the watermark passes it and no record is mistaken for it.
    pub(crate) fn fetched_at(&mut self, offsets: impl IntoIterator<Item = u64>) {
        for offset in offsets {
            let end = self.fetched_end();
            if offset < end {
                debug_assert!(false, "offset {offset} fetched twice");
                continue;
            }
            self.slots.extend((end..offset).map(|_| Slot::Done));
            self.slots.push_back(Slot::Pending);
            self.pending += 1;
        }
        // Gaps at the front: the front is always pending.
        self.advance(&mut Vec::new());
    }

    /// Completes `offset`, holding `held` (if any) until the watermark passes
    /// it; then moves the watermark over the completed prefix, appending the
    /// values released on the way to `released`, in offset order.
    pub(crate) fn complete(&mut self, offset: u64, held: Option<T>, released: &mut Vec<T>) {
        let index = offset
            .checked_sub(self.watermark)
            .map(|i| i as usize)
            .filter(|&i| i < self.slots.len());
        let Some(i) = index else {
            debug_assert!(false, "offset {offset} was never fetched or completed twice");
            return;
        };
        debug_assert!(
            matches!(self.slots[i], Slot::Pending),
            "offset {offset} completed twice"
        );
        if matches!(self.slots[i], Slot::Pending) {
            self.pending -= 1;
        }
        self.slots[i] = match held {
            Some(value) => Slot::Held(value),
            None => Slot::Done,
        };
        if i == 0 {
            self.advance(released);
        }
    }

    fn advance(&mut self, released: &mut Vec<T>) {
        loop {
            match self.slots.front() {
                None | Some(Slot::Pending) => return,
                Some(_) => {}
            }
            if let Some(Slot::Held(value)) = self.slots.pop_front() {
                released.push(value);
            }
            self.watermark += 1;
        }
    }

    /// Forgets every fetched offset that has not completed and every held
    /// value: the task is being removed, and they will be processed again by
    /// whoever resumes at the watermark.
    pub(crate) fn truncate_to_watermark(&mut self) {
        self.slots.clear();
        self.pending = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Applies a permutation given by sort keys.
    fn permuted<T: Clone>(items: &[T], keys: &[u32]) -> Vec<T> {
        let mut indexed: Vec<(u32, usize)> = (0..items.len()).map(|i| (keys[i % keys.len()], i)).collect();
        indexed.sort();
        indexed.into_iter().map(|(_, i)| items[i].clone()).collect()
    }

    proptest! {
        /// Any completion order, interleaved with uneven fetches: held values
        /// are released in strictly increasing offsets with no gap and no
        /// duplicate, exactly the completed prefix, and the watermark is that
        /// prefix after every step.
        #[test]
        fn held_values_are_released_in_offset_order_and_the_watermark_is_the_completed_prefix(
            total in 1u64..400,
            keys in proptest::collection::vec(any::<u32>(), 1..64),
            fetch_steps in proptest::collection::vec(1usize..100, 1..8),
        ) {
            let offsets: Vec<u64> = (0..total).collect();
            let order = permuted(&offsets, &keys);
            let mut seq = Sequencer::new(0);
            let mut completed = vec![false; total as usize];
            let mut delivered: Vec<u64> = Vec::new();
            let mut fetch_steps = fetch_steps.into_iter().cycle();
            let mut next = order.into_iter().peekable();
            while let Some(&offset) = next.peek() {
                if seq.fetched_end() <= offset {
                    let step = fetch_steps.next().unwrap().min((total - seq.fetched_end()) as usize);
                    seq.fetched(step);
                    continue;
                }
                next.next();
                prop_assert!(!seq.is_completed(offset));
                seq.complete(offset, Some(offset), &mut delivered);
                prop_assert!(seq.is_completed(offset));
                completed[offset as usize] = true;
                let prefix = completed.iter().take_while(|&&c| c).count() as u64;
                prop_assert_eq!(seq.watermark(), prefix);
                prop_assert_eq!(&delivered, &(0..prefix).collect::<Vec<_>>());
                let done = completed.iter().filter(|&&c| c).count();
                prop_assert_eq!(seq.pending(), (seq.fetched_end() as usize) - done);
            }
            prop_assert_eq!(seq.span(), 0);
        }

        /// Fetches with gaps (offsets holding no record), in any completion
        /// order: the watermark is the first record not completed (or the
        /// fetch end), and the held values come out in offset order.
        #[test]
        fn gaps_are_passed_and_records_released_in_offset_order(
            present in proptest::collection::vec(any::<bool>(), 1..300),
            keys in proptest::collection::vec(any::<u32>(), 1..64),
            fetch_steps in proptest::collection::vec(1usize..50, 1..8),
        ) {
            let records: Vec<u64> = (0..present.len() as u64).filter(|&o| present[o as usize]).collect();
            let end = present.len() as u64;
            let mut seq = Sequencer::new(0);
            // Fetched in steps; the last fetch reaches past the trailing gap only if a record follows it.
            let mut at = 0;
            for step in fetch_steps.iter().cycle() {
                if at >= records.len() {
                    break;
                }
                let upto = (at + step).min(records.len());
                seq.fetched_at(records[at..upto].iter().copied());
                at = upto;
            }
            let fetched_end = records.last().map_or(0, |&last| last + 1);
            prop_assert_eq!(seq.fetched_end(), fetched_end);
            let mut completed = std::collections::BTreeSet::new();
            let mut released = Vec::new();
            for offset in permuted(&records, &keys) {
                seq.complete(offset, Some(offset), &mut released);
                completed.insert(offset);
                let first_open = records.iter().copied().find(|o| !completed.contains(o));
                prop_assert_eq!(seq.watermark(), first_open.unwrap_or(fetched_end));
                let below: Vec<u64> = records.iter().copied().filter(|&o| o < seq.watermark()).collect();
                prop_assert_eq!(&released, &below);
            }
            prop_assert!(seq.watermark() <= end);
            prop_assert_eq!((seq.span(), seq.pending()), (0, 0));
        }

        /// Completion without holding: the watermark is the completed prefix
        /// and `completed_above` lists exactly the completed offsets past it.
        #[test]
        fn scattered_completions_keep_the_watermark_at_the_prefix(
            total in 1usize..300,
            start in 0u64..1_000,
            keys in proptest::collection::vec(any::<u32>(), 1..64),
        ) {
            let mut seq: Sequencer<()> = Sequencer::new(start);
            seq.fetched(total);
            let offsets: Vec<u64> = (0..total as u64).collect();
            let mut completed = vec![false; total];
            for offset in permuted(&offsets, &keys) {
                let mut released = Vec::new();
                seq.complete(start + offset, None, &mut released);
                prop_assert!(released.is_empty());
                completed[offset as usize] = true;
                let prefix = completed.iter().take_while(|&&c| c).count();
                prop_assert_eq!(seq.watermark(), start + prefix as u64);
                let above: Vec<u64> = (prefix..total)
                    .filter(|&i| completed[i])
                    .map(|i| start + i as u64)
                    .collect();
                prop_assert_eq!(seq.completed_above(), above);
            }
            prop_assert_eq!(seq.watermark(), start + total as u64);
        }
    }

    #[test]
    fn offsets_skipped_by_a_fetch_are_gaps_the_watermark_passes() {
        let mut seq = Sequencer::new(10);
        // Records at 10, 12 and 15; 11, 13 and 14 hold none (markers).
        seq.fetched_at([10, 12, 15]);
        assert_eq!((seq.watermark(), seq.fetched_end(), seq.pending()), (10, 16, 3));
        let mut released = Vec::new();
        seq.complete(15, Some(15), &mut released);
        seq.complete(10, Some(10), &mut released);
        assert_eq!(seq.watermark(), 12, "past 10 and the gap at 11");
        assert_eq!(seq.completed_above(), vec![13, 14, 15]);
        seq.complete(12, Some(12), &mut released);
        assert_eq!(released, vec![10, 12, 15]);
        assert_eq!((seq.watermark(), seq.pending(), seq.span()), (16, 0, 0));
        // A gap at the front is passed at once.
        seq.fetched_at([18]);
        assert_eq!((seq.watermark(), seq.fetched_end()), (18, 19));
        seq.fetched_at([]);
        assert_eq!(seq.fetched_end(), 19);
    }

    #[test]
    fn truncating_forgets_what_is_above_the_watermark() {
        let mut seq = Sequencer::new(10);
        seq.fetched(5);
        let mut released = Vec::new();
        seq.complete(10, Some("a"), &mut released);
        seq.complete(12, Some("c"), &mut released);
        assert_eq!(released, vec!["a"]);
        seq.truncate_to_watermark();
        assert_eq!((seq.watermark(), seq.fetched_end(), seq.pending()), (11, 11, 0));
        seq.fetched(2);
        seq.complete(11, Some("b"), &mut released);
        assert_eq!(released, vec!["a", "b"]);
    }
}
