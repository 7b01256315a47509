//! `Entry`: a key and its value as a `MemoryStore` shard keeps them, in one
//! 64-byte slot of the shard's hash table. Together they fit the slot as long
//! as they are short (most keys, with counters' and small records' values),
//! so a point read or an overwrite touches one cache line: the slot. Longer
//! ones keep the key in the slot when it is short and the value apart.

use super::compact::COPIED_MAX;
use bytes::Bytes;

/// Bytes of key and value together that the slot holds.
const INLINE_MAX: usize = 61;

/// Longest key kept in the slot beside a value kept apart.
const SHORT_KEY_MAX: usize = 22;

/// Invariant: `Inline` exactly when key and value together are at most
/// `INLINE_MAX` bytes; else `ShortKey` exactly when the key is at most
/// `SHORT_KEY_MAX` bytes. So an entry's variant follows from its lengths.
#[repr(align(64))]
pub(super) enum Entry {
    /// `bytes[..key_len]` is the key, the next `value_len` bytes the value.
    Inline {
        key_len: u8,
        value_len: u8,
        bytes: [u8; INLINE_MAX],
    },
    ShortKey {
        key_len: u8,
        key: [u8; SHORT_KEY_MAX],
        value: Bytes,
    },
    LongKey {
        key: Box<[u8]>,
        value: Bytes,
    },
}

impl Entry {
    pub(super) fn new(key: &[u8], value: Bytes) -> Entry {
        if key.len() + value.len() <= INLINE_MAX {
            let mut bytes = [0u8; INLINE_MAX];
            bytes[..key.len()].copy_from_slice(key);
            bytes[key.len()..key.len() + value.len()].copy_from_slice(&value);
            // Both at most INLINE_MAX (61): they fit a u8.
            Entry::Inline {
                key_len: key.len() as u8,
                value_len: value.len() as u8,
                bytes,
            }
        } else if key.len() <= SHORT_KEY_MAX {
            let mut short = [0u8; SHORT_KEY_MAX];
            short[..key.len()].copy_from_slice(key);
            Entry::ShortKey {
                // At most SHORT_KEY_MAX (22): fits a u8.
                key_len: key.len() as u8,
                key: short,
                value,
            }
        } else {
            Entry::LongKey {
                key: key.into(),
                value,
            }
        }
    }

    pub(super) fn key(&self) -> &[u8] {
        match self {
            Entry::Inline { key_len, bytes, .. } => &bytes[..usize::from(*key_len)],
            Entry::ShortKey { key_len, key, .. } => &key[..usize::from(*key_len)],
            Entry::LongKey { key, .. } => key,
        }
    }

    pub(super) fn value(&self) -> &[u8] {
        match self {
            Entry::Inline {
                key_len,
                value_len,
                bytes,
            } => {
                let start = usize::from(*key_len);
                &bytes[start..start + usize::from(*value_len)]
            }
            Entry::ShortKey { value, .. } | Entry::LongKey { value, .. } => value,
        }
    }

    /// The value for a reader: a copy when short, else the shared buffer.
    pub(super) fn value_bytes(&self) -> Bytes {
        match self {
            Entry::ShortKey { value, .. } | Entry::LongKey { value, .. } if value.len() > COPIED_MAX => {
                value.clone()
            }
            _ => Bytes::copy_from_slice(self.value()),
        }
    }

    /// The value, giving up the entry: no copy when kept apart.
    pub(super) fn into_value(self) -> Bytes {
        match self {
            Entry::ShortKey { value, .. } | Entry::LongKey { value, .. } => value,
            inline @ Entry::Inline { .. } => Bytes::copy_from_slice(inline.value()),
        }
    }

    /// Replaces the value, moving the entry to the variant its new lengths
    /// call for.
    pub(super) fn set_value(&mut self, value: Bytes) {
        // The common overwrites first, in place: a counter's new value beside
        // its key, or a long value in place of another.
        match self {
            Entry::Inline {
                key_len,
                value_len,
                bytes,
            } if usize::from(*key_len) + value.len() <= INLINE_MAX => {
                let start = usize::from(*key_len);
                bytes[start..start + value.len()].copy_from_slice(&value);
                // At most INLINE_MAX (61): fits a u8.
                *value_len = value.len() as u8;
                return;
            }
            Entry::ShortKey {
                key_len, value: slot, ..
            } if usize::from(*key_len) + value.len() > INLINE_MAX => {
                *slot = value;
                return;
            }
            Entry::LongKey { key, value: slot } if key.len() + value.len() > INLINE_MAX => {
                *slot = value;
                return;
            }
            _ => {}
        }
        // Any key left is at most INLINE_MAX long: an inline entry's, a
        // short one, or a long one that now fits inline with its value.
        let mut key = [0u8; INLINE_MAX];
        let len = self.key().len();
        key[..len].copy_from_slice(self.key());
        *self = Entry::new(&key[..len], value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(len: usize, byte: u8) -> Bytes {
        Bytes::from(vec![byte; len])
    }

    #[test]
    fn an_entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Entry>(), 64);
    }

    #[test]
    fn every_length_of_key_and_value_reads_back_in_the_variant_it_calls_for() {
        let lengths = [0, 1, 21, 22, 23, 36, 60, 61, 62, 64, 65, 300];
        for key_len in lengths {
            for value_len in lengths {
                let key = filled(key_len, 1);
                let value = filled(value_len, 2);
                let entry = Entry::new(&key, value.clone());
                let expected = if key_len + value_len <= INLINE_MAX {
                    "inline"
                } else if key_len <= SHORT_KEY_MAX {
                    "short key"
                } else {
                    "long key"
                };
                let variant = match entry {
                    Entry::Inline { .. } => "inline",
                    Entry::ShortKey { .. } => "short key",
                    Entry::LongKey { .. } => "long key",
                };
                assert_eq!(variant, expected, "key {key_len}, value {value_len}");
                assert_eq!(entry.key(), &key[..]);
                assert_eq!(entry.value(), &value[..]);
                assert_eq!(entry.value_bytes(), value);
                assert_eq!(entry.into_value(), value);
            }
        }
    }

    #[test]
    fn a_new_value_moves_the_entry_between_variants_and_keeps_its_key() {
        for key_len in [3, 22, 40] {
            let key = filled(key_len, 9);
            let mut entry = Entry::new(&key, filled(1, 1));
            for value_len in [100, 2, 61 - key_len, 70, 0, 5_000, 7] {
                let value = filled(value_len, value_len as u8);
                entry.set_value(value.clone());
                assert_eq!(entry.key(), &key[..]);
                assert_eq!(entry.value(), &value[..]);
                let inline = matches!(entry, Entry::Inline { .. });
                assert_eq!(
                    inline,
                    key_len + value_len <= INLINE_MAX,
                    "key {key_len}, value {value_len}"
                );
            }
        }
    }

    #[test]
    fn a_long_value_is_shared_with_its_reader_and_a_short_one_copied() {
        let long = filled(COPIED_MAX + 1, 7);
        assert_eq!(
            Entry::new(b"k", long.clone()).value_bytes().as_ptr(),
            long.as_ptr()
        );
        let medium = filled(COPIED_MAX, 7);
        assert_ne!(
            Entry::new(b"k", medium.clone()).value_bytes().as_ptr(),
            medium.as_ptr()
        );
    }
}
