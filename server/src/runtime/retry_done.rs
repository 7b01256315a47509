//! The final retry entries above a committed retry position, written as the
//! metadata of that position's offset commit on Kafka, so that whichever
//! instance takes the partition next (this one after a restart, or another)
//! skips them instead of running them again — under exactly-once a second
//! run would be a second apply.

/// What every metadata written here starts with; anything else (empty, or
/// written by another tool) carries no final entries.
const PREFIX: &str = "rd1:";

/// Kafka's default `offset.metadata.max.bytes`: a longer text is refused.
const MAX_METADATA_BYTES: usize = 4_096;

/// Offsets per character.
const BITS: u64 = 6;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// The metadata recording `done` (final entries, sorted; those below
/// `position` are ignored), and how many of them it leaves off for want of
/// room.
///
/// Format: `rd1:` and then a bitmap of the offsets from the position on, six
/// offsets per character (`ALPHABET[bits]`, lowest offset in the lowest bit),
/// trailing zeros left off. It stays within Kafka's default
/// `offset.metadata.max.bytes` (4,096): 24,552 offsets past the position,
/// more than the retry queue loads at once with the default
/// `max_in_flight_records` (10,000). Entries beyond that are left off and
/// would run again.
pub(crate) fn encode(position: u64, done: &[u64]) -> (String, usize) {
    let max_chars = (MAX_METADATA_BYTES - PREFIX.len()) as u64;
    let mut chars: Vec<u8> = Vec::new();
    let mut left_off = 0;
    for &offset in done.iter().filter(|&&o| o >= position) {
        let distance = offset - position;
        let index = distance / BITS;
        if index >= max_chars {
            left_off += 1;
            continue;
        }
        let index = index as usize;
        if chars.len() <= index {
            chars.resize(index + 1, 0);
        }
        chars[index] |= 1 << (distance % BITS);
    }
    let mut text = String::with_capacity(PREFIX.len() + chars.len());
    text.push_str(PREFIX);
    text.extend(chars.iter().map(|&bits| char::from(ALPHABET[usize::from(bits)])));
    (text, left_off)
}

/// The final entries `metadata` records above `position`, in order; none if
/// it was not written by `encode` (another tool's, or damaged).
pub(crate) fn decode(position: u64, metadata: &str) -> Vec<u64> {
    let Some(bitmap) = metadata.strip_prefix(PREFIX) else {
        return Vec::new();
    };
    let mut done = Vec::new();
    for (index, char) in bitmap.bytes().enumerate() {
        let Some(bits) = ALPHABET.iter().position(|&a| a == char) else {
            tracing::warn!(
                metadata,
                "unreadable final retry entries in the committed metadata; none taken"
            );
            return Vec::new();
        };
        for bit in 0..BITS {
            if bits & (1 << bit) != 0 {
                done.push(position + index as u64 * BITS + bit);
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nothing_final_is_the_prefix_alone() {
        assert_eq!(encode(17, &[]), ("rd1:".to_string(), 0));
        assert_eq!(decode(17, "rd1:"), Vec::<u64>::new());
    }

    #[test]
    fn offsets_are_bits_from_the_position() {
        // 10 → bit 0 of char 0; 15 → bit 5 of char 0; 16 → bit 0 of char 1.
        let (text, left_off) = encode(10, &[10, 15, 16]);
        assert_eq!(left_off, 0);
        assert_eq!(
            text,
            format!("rd1:{}{}", ALPHABET[0b10_0001] as char, ALPHABET[1] as char)
        );
        assert_eq!(decode(10, &text), vec![10, 15, 16]);
    }

    #[test]
    fn offsets_below_the_position_are_not_recorded() {
        let (text, left_off) = encode(100, &[98, 99, 101]);
        assert_eq!(left_off, 0);
        assert_eq!(decode(100, &text), vec![101]);
    }

    #[test]
    fn metadata_not_written_here_records_nothing() {
        assert_eq!(decode(5, ""), Vec::<u64>::new());
        assert_eq!(decode(5, "written by a tool"), Vec::<u64>::new());
        assert_eq!(decode(5, "rd1:AB*"), Vec::<u64>::new());
    }

    #[test]
    fn what_does_not_fit_kafkas_limit_is_left_off_and_counted() {
        let last_fitting = (MAX_METADATA_BYTES - PREFIX.len()) as u64 * BITS - 1;
        let done = [0, last_fitting, last_fitting + 1, last_fitting + 50];
        let (text, left_off) = encode(0, &done);
        assert_eq!(text.len(), MAX_METADATA_BYTES);
        assert_eq!(left_off, 2);
        assert_eq!(decode(0, &text), vec![0, last_fitting]);
    }

    proptest! {
        /// A round trip gives back the recorded offsets at or above the
        /// position, and the text is never over Kafka's limit.
        #[test]
        fn round_trip(
            position in 0u64..1 << 40,
            distances in proptest::collection::btree_set(0u64..30_000, 0..400),
        ) {
            let done: Vec<u64> = distances.iter().map(|d| position + d).collect();
            let (text, left_off) = encode(position, &done);
            prop_assert!(text.len() <= MAX_METADATA_BYTES);
            let fitting: Vec<u64> = done
                .iter()
                .copied()
                .filter(|o| (o - position) / BITS < (MAX_METADATA_BYTES - PREFIX.len()) as u64)
                .collect();
            prop_assert_eq!(left_off, done.len() - fitting.len());
            prop_assert_eq!(decode(position, &text), fitting);
        }
    }
}
