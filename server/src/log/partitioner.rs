//! Key → partition exactly as Apache Kafka's default partitioner:
//! `(murmur2(key) & 0x7fffffff) % partitions` (Kafka's `Utils.murmur2`).

/// Kafka's 32-bit murmur2 (seed 0x9747b28c), as `Utils.murmur2` computes it.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let length = data.len();
    let mut h: u32 = SEED ^ (length as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= (tail[2] as u32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as u32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Kafka's default partitioner picks for a keyed record.
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    ((murmur2(key) as u32) & 0x7fff_ffff) % partitions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_every_row_of_kafkas_vectors() {
        // Computed with Kafka's partitioner; see server/tests/data/README.md.
        let text = include_str!("../../tests/data/kafka-default-partitioner.tsv");
        let mut rows = 0;
        for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let cols: Vec<&str> = line.split('\t').collect();
            assert_eq!(cols.len(), 5, "row {line:?}");
            let key = cols[0].as_bytes();
            assert_eq!(
                murmur2(key),
                cols[1].parse::<i32>().unwrap(),
                "murmur2 of {:?}",
                cols[0]
            );
            for (partitions, col) in [(8, 2), (12, 3), (100, 4)] {
                assert_eq!(
                    partition_for_key(key, partitions),
                    cols[col].parse::<u32>().unwrap(),
                    "partition of {:?} among {partitions}",
                    cols[0]
                );
            }
            rows += 1;
        }
        assert_eq!(rows, 18);
    }
}
