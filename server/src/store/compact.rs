//! `Compact`: the keys of a `MemoryStore` shard's key order. Short ones
//! (most keys) live in the set's own slot, longer ones in a shared `Bytes`,
//! so a range walks the order without a pointer to follow per key for most
//! keys. (The shard's hash table keeps keys and values in `entry::Entry`.)

use bytes::Bytes;
use std::borrow::Borrow;
use std::cmp::Ordering;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

/// Longest byte string kept in the slot: with its length and the variant's
/// tag, the size of the `Bytes` variant (40 bytes), so inline costs nothing.
const INLINE_MAX: usize = 38;

/// Values up to this size are copied out on a read rather than shared.
/// Sharing a `Bytes` made from a `Vec` allocates a shared header at its first
/// clone, and every clone and drop touches that header: for a value this
/// small, a copy reads only the value, which its reader reads anyway.
pub(super) const COPIED_MAX: usize = 64;

/// A byte string as the memory store keeps it. Compares, orders and hashes
/// as the `[u8]` it holds, so maps keyed by it are looked up by `&[u8]`.
#[derive(Clone)]
pub(super) enum Compact {
    Inline { len: u8, bytes: [u8; INLINE_MAX] },
    Shared(Bytes),
}

impl Compact {
    /// A copy of `slice`: in the slot when short, else in a buffer of its own.
    pub(super) fn copy_from(slice: &[u8]) -> Compact {
        if slice.len() <= INLINE_MAX {
            Compact::inline(slice)
        } else {
            Compact::Shared(Bytes::copy_from_slice(slice))
        }
    }

    fn inline(slice: &[u8]) -> Compact {
        debug_assert!(slice.len() <= INLINE_MAX);
        let mut bytes = [0u8; INLINE_MAX];
        bytes[..slice.len()].copy_from_slice(slice);
        Compact::Inline {
            // At most INLINE_MAX (38): fits a u8.
            len: slice.len() as u8,
            bytes,
        }
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Compact::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Compact::Shared(bytes) => bytes,
        }
    }

    /// The bytes for a reader: a copy when short, else the shared buffer.
    pub(super) fn to_bytes(&self) -> Bytes {
        match self {
            Compact::Shared(bytes) if bytes.len() > COPIED_MAX => bytes.clone(),
            _ => Bytes::copy_from_slice(self.as_slice()),
        }
    }
}

impl Deref for Compact {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Borrow<[u8]> for Compact {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Hash for Compact {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As the slice does: `Borrow<[u8]>` lookups must find it.
        self.as_slice().hash(state);
    }
}

impl PartialEq for Compact {
    fn eq(&self, other: &Compact) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Compact {}

impl PartialOrd for Compact {
    fn partial_cmp(&self, other: &Compact) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Compact {
    fn cmp(&self, other: &Compact) -> Ordering {
        self.as_slice().cmp(other.as_slice())
    }
}

impl std::fmt::Debug for Compact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&Bytes::copy_from_slice(self.as_slice()), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn copy_of(slice: &[u8]) -> Compact {
        Compact::copy_from(slice)
    }

    #[test]
    fn a_compact_string_is_no_bigger_than_a_shared_one() {
        assert_eq!(std::mem::size_of::<Compact>(), 40);
    }

    #[test]
    fn short_strings_are_inline_long_ones_shared_and_both_read_back() {
        for len in [
            0,
            1,
            INLINE_MAX,
            INLINE_MAX + 1,
            COPIED_MAX,
            COPIED_MAX + 1,
            1_000,
        ] {
            let bytes = Bytes::from((0..len).map(|i| i as u8).collect::<Vec<u8>>());
            let compact = copy_of(&bytes);
            assert_eq!(matches!(compact, Compact::Inline { .. }), len <= INLINE_MAX);
            assert_eq!(compact.as_slice(), &bytes[..]);
            assert_eq!(compact.to_bytes(), bytes);
        }
    }

    #[test]
    fn a_long_value_is_shared_with_its_reader_and_a_short_one_copied() {
        let long = copy_of(&[7u8; COPIED_MAX + 1]);
        assert_eq!(long.to_bytes().as_ptr(), long.to_bytes().as_ptr());
        let medium = copy_of(&[7u8; COPIED_MAX]);
        assert_ne!(medium.to_bytes().as_ptr(), medium.to_bytes().as_ptr());
    }

    #[test]
    fn maps_keyed_by_compact_strings_are_looked_up_by_slices_in_either_form() {
        let long = vec![b'k'; 100];
        let mut map = HashMap::new();
        map.insert(copy_of(b"short"), 1);
        map.insert(copy_of(&long), 2);
        assert_eq!(map.get(&b"short"[..]), Some(&1));
        assert_eq!(map.get(&long[..]), Some(&2));
        assert_eq!(map.get(&b"shor"[..]), None);
        assert!(copy_of(b"a") < copy_of(&long));
        assert!(copy_of(b"kz") > copy_of(&long));
    }
}
