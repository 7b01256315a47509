//! Bisection of calls that fail at the transport: which records of a
//! pipeline are *suspect* (were in a call that failed at the transport), how
//! large their next call may be, and when a failure counts against a record.
//! No I/O: the remote processor feeds it calls and their ends, and tests
//! drive it step by step.
//!
//! The rule (the README's "A processor crash is not an outage", and
//! processor.proto):
//! - a call of k > 1 records that fails at the transport makes its records
//!   suspect, sent again as two halves (⌈k/2⌉ and ⌊k/2⌋); a half that is
//!   answered clears its records, a half that fails is split again;
//! - a record's first failure never counts (it may just have been in flight
//!   when the processor restarted); a one-record call of a suspect that
//!   fails at the transport counts as a crash of that record only if a call
//!   started after its previous failure was answered (evidence that the
//!   processor was up in between). At `max_attempts` crashes the record is
//!   dead-lettered (`ProcessorCrashed`);
//! - when no call is answered between failures (the processor is down),
//!   nothing is split further and nothing counts: the pipeline waits.
//!
//! Invariants: at most one suspect call is in flight per pipeline (`testing`),
//! so a crash is not blamed on the records of another suspect call that
//! happened to be in flight with it; `evidence <= failures`; a suspect's
//! `failed_at` is the sequence number of its latest failure; at most
//! `MAX_SUSPECTS` records are suspect (beyond that a failing call only
//! pauses, as it did before bisection).

use std::collections::HashMap;

/// Suspect records kept at most (an outage makes every thread's first call
/// suspect, at most `max_records_per_call` records each; records of a task
/// that moved away stay until the bound).
const MAX_SUSPECTS: usize = 65_536;

/// A record of the pipeline's source: partition and offset.
pub(crate) type At = (u32, u64);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Suspect {
    /// The most records its next call may carry.
    cap: usize,
    /// The failure that set `cap`: records split from one call share it, so
    /// a half is sent as one call and not mixed with other suspects.
    group: u64,
    /// The sequence number of its latest failure.
    failed_at: u64,
    /// Failures that counted as crashes.
    crashes: u32,
}

/// What a call over some records must do first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Begin {
    /// No suspect: send as usual.
    Plain,
    /// Another suspect call is in flight: wait for it.
    Wait,
    /// This call is the pipeline's suspect call; `probe`: no call was
    /// answered since its records last failed, so an empty call asks first
    /// whether the processor is up.
    Suspect { probe: bool },
}

/// What a transport failure of a sent call means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its records are sent again in two calls of these sizes.
    Split { first: usize, second: usize },
    /// The first failure of a lone record: suspect, not counted.
    Suspect,
    /// A lone suspect crashed the processor again (the count so far).
    Crashed { crashes: u32 },
    /// A lone suspect crashed the processor `crashes` times: dead-letter it.
    DeadLetter { crashes: u32 },
    /// Nothing was answered since these records last failed: the processor
    /// is down, not crashed by them. Nothing changes; the pipeline waits.
    Down,
    /// Too many suspects already: the call only pauses.
    Untracked,
}

/// The bisection state of one pipeline.
#[derive(Debug)]
pub(crate) struct Bisect {
    max_attempts: u32,
    /// Transport failures so far; the latest one's sequence number.
    failures: u64,
    /// The highest ticket of an answered call: every failure up to it was
    /// followed by a call that started after it and was answered.
    evidence: u64,
    suspects: HashMap<At, Suspect>,
    testing: bool,
}

impl Bisect {
    pub(crate) fn new(max_attempts: u32) -> Bisect {
        Bisect {
            max_attempts: max_attempts.max(1),
            failures: 0,
            evidence: 0,
            suspects: HashMap::new(),
            testing: false,
        }
    }

    pub(crate) fn has_suspects(&self) -> bool {
        !self.suspects.is_empty()
    }

    pub(crate) fn is_suspect(&self, partition: u32, offset: u64) -> bool {
        self.suspects.contains_key(&(partition, offset))
    }

    pub(crate) fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Taken when a call starts; given back with its answer.
    pub(crate) fn ticket(&self) -> u64 {
        self.failures
    }

    /// How many of `offsets` (the records of a call, in order, at least one)
    /// the call may carry: a suspect's group up to its cap, or the records
    /// before the first suspect.
    pub(crate) fn cut(&self, partition: u32, offsets: &[u64]) -> usize {
        let Some(first) = offsets.first() else {
            return 0;
        };
        let n = match self.suspects.get(&(partition, *first)) {
            Some(s) => offsets
                .iter()
                .take(s.cap)
                .take_while(|&&o| {
                    self.suspects
                        .get(&(partition, o))
                        .is_some_and(|t| t.group == s.group)
                })
                .count(),
            None => offsets
                .iter()
                .take_while(|&&o| !self.suspects.contains_key(&(partition, o)))
                .count(),
        };
        n.max(1)
    }

    /// Before a call over `offsets` (already [`cut`](Self::cut)).
    pub(crate) fn begin(&mut self, partition: u32, offsets: &[u64]) -> Begin {
        let last_failure = offsets
            .iter()
            .filter_map(|&o| self.suspects.get(&(partition, o)))
            .map(|s| s.failed_at)
            .max();
        let Some(last_failure) = last_failure else {
            return Begin::Plain;
        };
        if self.testing {
            return Begin::Wait;
        }
        self.testing = true;
        Begin::Suspect {
            probe: self.evidence < last_failure,
        }
    }

    /// The suspect call that [`begin`](Self::begin) allowed has ended.
    pub(crate) fn end(&mut self) {
        self.testing = false;
    }

    /// A call that started with `ticket` was answered (a probe has no
    /// records): the processor was up after every failure up to the ticket.
    /// Answers how many suspects it cleared.
    pub(crate) fn answered(&mut self, ticket: u64, partition: u32, offsets: &[u64]) -> usize {
        self.evidence = self.evidence.max(ticket);
        if self.suspects.is_empty() {
            return 0;
        }
        offsets
            .iter()
            .filter(|&&o| self.suspects.remove(&(partition, o)).is_some())
            .count()
    }

    /// A sent call over `offsets` failed at the transport.
    pub(crate) fn failed(&mut self, partition: u32, offsets: &[u64]) -> Verdict {
        self.failures += 1;
        let seq = self.failures;
        let evidence = self.evidence;
        let fresh = |s: Option<&Suspect>| s.is_none_or(|s| evidence >= s.failed_at);
        if !offsets.iter().any(|&o| fresh(self.suspects.get(&(partition, o)))) {
            return Verdict::Down;
        }
        let new = offsets
            .iter()
            .filter(|&&o| !self.suspects.contains_key(&(partition, o)))
            .count();
        if self.suspects.len() + new > MAX_SUSPECTS {
            return Verdict::Untracked;
        }
        if let [offset] = offsets {
            let Some(suspect) = self.suspects.get_mut(&(partition, *offset)) else {
                self.suspects.insert(
                    (partition, *offset),
                    Suspect {
                        cap: 1,
                        group: seq,
                        failed_at: seq,
                        crashes: 0,
                    },
                );
                return Verdict::Suspect;
            };
            suspect.crashes += 1;
            suspect.failed_at = seq;
            let crashes = suspect.crashes;
            if crashes >= self.max_attempts {
                self.suspects.remove(&(partition, *offset));
                return Verdict::DeadLetter { crashes };
            }
            return Verdict::Crashed { crashes };
        }
        let first = offsets.len().div_ceil(2);
        for &o in offsets {
            let suspect = self.suspects.entry((partition, o)).or_insert(Suspect {
                cap: first,
                group: seq,
                failed_at: seq,
                crashes: 0,
            });
            suspect.cap = first;
            suspect.group = seq;
            suspect.failed_at = seq;
        }
        Verdict::Split {
            first,
            second: offsets.len() - first,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets `from..to` of partition 0.
    fn span(from: u64, to: u64) -> Vec<u64> {
        (from..to).collect()
    }

    /// One call as the remote processor makes it: cut, begin (with the
    /// probe, answered when `up`), then `crashes(offsets)` says whether it
    /// failed. Answers the call's offsets and its verdict, if it failed.
    fn call(
        b: &mut Bisect,
        offsets: &[u64],
        up: bool,
        crashes: impl Fn(&[u64]) -> bool,
    ) -> (Vec<u64>, Option<Verdict>) {
        let sent = offsets[..b.cut(0, offsets)].to_vec();
        let ticket = b.ticket();
        let begin = b.begin(0, &sent);
        assert_ne!(begin, Begin::Wait);
        let suspect = matches!(begin, Begin::Suspect { .. });
        let result = if begin == (Begin::Suspect { probe: true }) && !up {
            (sent, None)
        } else {
            if begin == (Begin::Suspect { probe: true }) {
                b.answered(ticket, 0, &[]);
            }
            if up && !crashes(&sent) {
                b.answered(ticket, 0, &sent);
                (sent, None)
            } else {
                let verdict = b.failed(0, &sent);
                (sent, Some(verdict))
            }
        };
        if suspect {
            b.end();
        }
        result
    }

    #[test]
    fn a_failed_call_is_split_in_halves_down_to_the_record_that_crashes() {
        let mut b = Bisect::new(3);
        let poison = |o: &[u64]| o.contains(&2);
        // 0..8 crashes: halves of 4.
        assert_eq!(
            call(&mut b, &span(0, 8), true, poison),
            (span(0, 8), Some(Verdict::Split { first: 4, second: 4 }))
        );
        // The first half crashes again (a probe first: nothing answered since).
        assert_eq!(
            call(&mut b, &span(0, 8), true, poison),
            (span(0, 4), Some(Verdict::Split { first: 2, second: 2 }))
        );
        assert_eq!(call(&mut b, &span(0, 8), true, poison), (span(0, 2), None));
        assert_eq!(
            call(&mut b, &span(2, 8), true, poison),
            (span(2, 4), Some(Verdict::Split { first: 1, second: 1 }))
        );
        // Alone, its failures count, each after an answered call (the probe).
        assert_eq!(
            call(&mut b, &span(2, 8), true, poison),
            (vec![2], Some(Verdict::Crashed { crashes: 1 }))
        );
        assert_eq!(
            call(&mut b, &span(2, 8), true, poison),
            (vec![2], Some(Verdict::Crashed { crashes: 2 }))
        );
        assert_eq!(
            call(&mut b, &span(2, 8), true, poison),
            (vec![2], Some(Verdict::DeadLetter { crashes: 3 }))
        );
        // The rest: its own halves, then plain calls again.
        assert_eq!(call(&mut b, &span(3, 8), true, poison), (vec![3], None));
        assert_eq!(call(&mut b, &span(4, 12), true, poison), (span(4, 8), None));
        assert!(!b.has_suspects());
        assert_eq!(call(&mut b, &span(8, 16), true, poison), (span(8, 16), None));
    }

    #[test]
    fn while_every_call_fails_nothing_is_split_further_and_nothing_counts() {
        let mut b = Bisect::new(1);
        let all = |_: &[u64]| true;
        assert_eq!(
            call(&mut b, &span(0, 4), false, all),
            (span(0, 4), Some(Verdict::Split { first: 2, second: 2 }))
        );
        for _ in 0..10 {
            // The probe is not answered: the suspect call is not even sent.
            assert_eq!(call(&mut b, &span(0, 4), false, all), (span(0, 2), None));
        }
        // A plain call of other records fails too: it becomes suspect, nothing counts.
        assert_eq!(
            call(&mut b, &[10], false, all),
            (vec![10], Some(Verdict::Suspect))
        );
        // A suspect sent without evidence (no probe made) is the processor being down.
        assert_eq!(b.failed(0, &[10]), Verdict::Down);
        assert_eq!(b.failed(0, &[0, 1]), Verdict::Down);
        // Back: everything goes through, nothing was dead-lettered.
        let none = |_: &[u64]| false;
        assert_eq!(call(&mut b, &span(0, 4), true, none), (span(0, 2), None));
        assert_eq!(call(&mut b, &span(2, 4), true, none), (span(2, 4), None));
        assert_eq!(call(&mut b, &[10, 11], true, none), (vec![10], None));
        assert!(!b.has_suspects());
    }

    #[test]
    fn a_lone_records_first_failure_never_counts() {
        let mut b = Bisect::new(1);
        assert_eq!(b.failed(0, &[7]), Verdict::Suspect);
        let ticket = b.ticket();
        b.answered(ticket, 0, &[]);
        assert_eq!(b.failed(0, &[7]), Verdict::DeadLetter { crashes: 1 });
        assert!(!b.has_suspects());
    }

    #[test]
    fn an_answer_to_a_call_that_started_before_a_failure_is_no_evidence() {
        let mut b = Bisect::new(2);
        let before = b.ticket();
        assert_eq!(b.failed(0, &[1]), Verdict::Suspect);
        // A call in flight before the failure answers after it.
        b.answered(before, 0, &[50]);
        assert_eq!(b.begin(0, &[1]), Begin::Suspect { probe: true });
        b.end();
        assert_eq!(b.failed(0, &[1]), Verdict::Down);
    }

    #[test]
    fn one_suspect_call_at_a_time_and_suspects_do_not_mix_with_other_records() {
        let mut b = Bisect::new(3);
        b.failed(0, &span(0, 4));
        b.failed(0, &[9]);
        assert_eq!(b.cut(0, &span(0, 10)), 2, "a half");
        assert_eq!(b.cut(0, &[5, 6, 9, 10]), 2, "records up to the next suspect");
        assert_eq!(b.cut(0, &[9, 10]), 1);
        assert_eq!(b.cut(1, &span(0, 4)), 4, "another partition");
        assert!(matches!(b.begin(0, &[0, 1]), Begin::Suspect { .. }));
        assert_eq!(b.begin(0, &[9]), Begin::Wait);
        assert_eq!(b.begin(0, &[5, 6]), Begin::Plain);
        b.end();
        assert!(matches!(b.begin(0, &[9]), Begin::Suspect { .. }));
    }
}
