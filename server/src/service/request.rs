//! Requests in: checks what the service can judge without the runtime (empty or
//! malformed names, keys, offsets, bounds, enum values) and turns proto requests
//! into runtime arguments. Every rejection is `RuntimeError::InvalidArgument`
//! naming the request field, so it reaches the client as a BadRequest violation.

use crate::config::Config;
use crate::log::ProducerRecord;
use crate::runtime::RangeResume;
use crate::runtime::retry::headers::RESERVED_PREFIXES;
use crate::runtime::{EndAt, StartAt, SubscribeRequest};
use crate::runtime::{MAX_ECHO_BYTES, RuntimeError, echo};
use std::collections::{BTreeMap, HashMap};
use taskstream::v1 as pb;

/// Longest store or topic name; the config accepts no longer names either.
const MAX_NAME_LEN: usize = 200;

/// Longest topic ReadTopic accepts: a retry topic `<application_id>-<pipeline>-retry`
/// joins two names of up to `MAX_NAME_LEN`.
const MAX_READ_TOPIC_LEN: usize = 2 * MAX_NAME_LEN + "--retry".len();

/// Records a ReadTopic returns when it does not say (`max_records = 0`).
pub const DEFAULT_READ_RECORDS: usize = 500;

/// Most records one ReadTopic may ask for: the answer is one message, and a
/// reader pages on from the last offset anyway.
pub const MAX_READ_RECORDS: usize = 10_000;

/// Store and topic names follow the config's rule (they end up in task ids and
/// topic names), so a name the config could never accept is malformed, not unknown.
pub fn check_name(field: &str, name: &str) -> Result<(), RuntimeError> {
    check_name_up_to(field, name, MAX_NAME_LEN)
}

fn check_name_up_to(field: &str, name: &str, max_len: usize) -> Result<(), RuntimeError> {
    if name.is_empty() {
        return Err(RuntimeError::invalid_argument(field, "must not be empty"));
    }
    if name.len() > max_len
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(RuntimeError::invalid_argument(
            field,
            format!(
                "`{}` is not a valid name: use letters, digits, `.`, `_` and `-` (at most {max_len})",
                // Escaped first, so that the cut is measured on what is shown.
                echo(&name.escape_debug().take(MAX_ECHO_BYTES + 1).collect::<String>())
            ),
        ));
    }
    Ok(())
}

pub fn check_store(store: &str) -> Result<(), RuntimeError> {
    check_name("store", store)
}

/// A GetMetadataAsync request as the runtime and the stream pump need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataStream {
    pub store: String,
    pub subscribe: SubscribeRequest,
    /// At most this many records per streamed message (0 = one message per batch).
    pub max_batch_records: usize,
}

pub fn metadata_stream(request: pb::GetMetadataAsyncRequest) -> Result<MetadataStream, RuntimeError> {
    check_store(&request.store)?;
    let start = match pb::StartPosition::try_from(request.start) {
        Ok(pb::StartPosition::Unspecified | pb::StartPosition::Latest) => {
            no_offsets_without_position("start_offsets", "START_POSITION_OFFSETS", &request.start_offsets)?;
            StartAt::Latest
        }
        Ok(pb::StartPosition::Earliest) => {
            no_offsets_without_position("start_offsets", "START_POSITION_OFFSETS", &request.start_offsets)?;
            StartAt::Earliest
        }
        Ok(pb::StartPosition::Offsets) => StartAt::Offsets(offsets(
            "start_offsets",
            "START_POSITION_OFFSETS",
            &request.start_offsets,
        )?),
        Err(_) => return Err(unknown_enum_value("start", request.start)),
    };
    let end = match pb::EndPosition::try_from(request.end) {
        Ok(pb::EndPosition::Unspecified | pb::EndPosition::Open) => {
            no_offsets_without_position("end_offsets", "END_POSITION_OFFSETS", &request.end_offsets)?;
            EndAt::Open
        }
        Ok(pb::EndPosition::Current) => {
            no_offsets_without_position("end_offsets", "END_POSITION_OFFSETS", &request.end_offsets)?;
            EndAt::Current
        }
        Ok(pb::EndPosition::Offsets) => EndAt::Offsets(offsets(
            "end_offsets",
            "END_POSITION_OFFSETS",
            &request.end_offsets,
        )?),
        Err(_) => return Err(unknown_enum_value("end", request.end)),
    };
    Ok(MetadataStream {
        store: request.store,
        subscribe: SubscribeRequest {
            in_order: request.in_order,
            start,
            end,
            partitions: request.partitions,
        },
        max_batch_records: request.max_batch_records as usize,
    })
}

fn unknown_enum_value(field: &str, value: i32) -> RuntimeError {
    RuntimeError::invalid_argument(field, format!("{value} is not a known value"))
}

/// Offsets given with a position that ignores them are most likely a client
/// mistake (a forgotten `start: START_POSITION_OFFSETS`); silently streaming
/// from somewhere else would hide it.
fn no_offsets_without_position(
    field: &str,
    position: &str,
    offsets: &HashMap<u32, i64>,
) -> Result<(), RuntimeError> {
    if offsets.is_empty() {
        Ok(())
    } else {
        Err(RuntimeError::invalid_argument(
            field,
            format!("offsets are only read with {position}; set it, or leave {field} empty"),
        ))
    }
}

fn offsets(
    field: &str,
    position: &str,
    offsets: &HashMap<u32, i64>,
) -> Result<BTreeMap<u32, u64>, RuntimeError> {
    if offsets.is_empty() {
        return Err(RuntimeError::invalid_argument(
            field,
            format!("{position} needs at least one partition → offset entry"),
        ));
    }
    // Sorted, so that with several bad entries the reported one is stable.
    let sorted: BTreeMap<u32, i64> = offsets.iter().map(|(&p, &o)| (p, o)).collect();
    sorted
        .into_iter()
        .map(|(partition, offset)| {
            u64::try_from(offset)
                .map(|offset| (partition, offset))
                .map_err(|_| {
                    RuntimeError::invalid_argument(
                        format!("{field}[{partition}]"),
                        format!("offset {offset} is negative; offsets start at 0"),
                    )
                })
        })
        .collect()
}

/// What a Query asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreQuery {
    Key(bytes::Bytes),
    Range {
        from: Option<bytes::Bytes>,
        to: Option<bytes::Bytes>,
        partitions: Vec<u32>,
        /// 0 = no limit.
        limit: usize,
        /// Where this page starts (from a page token); `None`: the first page.
        resume: Option<RangeResume>,
    },
}

/// A Query request as the handler routes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryArgs {
    pub store: String,
    pub query: StoreQuery,
    /// Answer from this instance's partitions only (see `QueryRequest.local_only`).
    pub local_only: bool,
}

pub fn store_query(request: pb::QueryRequest) -> Result<QueryArgs, RuntimeError> {
    check_store(&request.store)?;
    let query = match request.query {
        None => {
            return Err(RuntimeError::invalid_argument(
                "query",
                "ask for a key or a range (set `key` or `range`)",
            ));
        }
        // A key lives in exactly one partition, so `partitions` and `limit`
        // have nothing to narrow for a key query.
        // The empty key is a key (as in Kafka), so every key is well formed.
        Some(pb::query_request::Query::Key(key)) => {
            if !request.page_token.is_empty() {
                return Err(RuntimeError::invalid_argument(
                    "page_token",
                    "a key query has one answer and no pages; leave page_token empty",
                ));
            }
            StoreQuery::Key(key.key)
        }
        Some(pb::query_request::Query::Range(range)) => {
            if let (Some(from), Some(to)) = (&range.from, &range.to)
                && from > to
            {
                return Err(RuntimeError::invalid_argument(
                    "range",
                    "`from` is greater than `to`; bounds are inclusive and `from` must not exceed `to`",
                ));
            }
            StoreQuery::Range {
                from: range.from,
                to: range.to,
                partitions: request.partitions,
                limit: request.limit as usize,
                resume: parse_page_token(&request.page_token)?,
            }
        }
    };
    Ok(QueryArgs {
        store: request.store,
        query,
        local_only: request.local_only,
    })
}

/// The bounds a Produce request keeps (settings of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProduceLimits {
    pub max_records: usize,
    pub max_key_bytes: usize,
    pub max_value_bytes: usize,
    pub max_header_bytes: usize,
}

impl ProduceLimits {
    pub fn of(config: &Config) -> Self {
        ProduceLimits {
            max_records: config.max_records_per_produce,
            max_key_bytes: config.max_key_bytes,
            max_value_bytes: config.max_value_bytes,
            max_header_bytes: config.max_header_bytes,
        }
    }
}

/// Checks the topic, the limits, and turns each proto record into a runtime record.
pub fn produce_batch(
    request: pb::ProduceRequest,
    limits: ProduceLimits,
) -> Result<(String, Vec<ProducerRecord>), RuntimeError> {
    check_name("topic", &request.topic)?;
    if request.records.len() > limits.max_records {
        return Err(RuntimeError::limit_exceeded(
            "max_records_per_produce",
            limits.max_records as u64,
            format!(
                "the request holds {} records; send them in several requests",
                request.records.len()
            ),
        ));
    }
    let records = request
        .records
        .into_iter()
        .enumerate()
        .map(|(i, record)| producer_record(i, record, limits))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((request.topic, records))
}

fn producer_record(
    index: usize,
    record: pb::ProducerRecord,
    limits: ProduceLimits,
) -> Result<ProducerRecord, RuntimeError> {
    let over = |field: &str, setting: &str, size: usize, limit: usize| {
        RuntimeError::limit_exceeded(
            setting,
            limit as u64,
            format!("records[{index}].{field} is {size} bytes"),
        )
    };
    if let Some(key) = &record.key
        && key.len() > limits.max_key_bytes
    {
        return Err(over("key", "max_key_bytes", key.len(), limits.max_key_bytes));
    }
    if record.value.len() > limits.max_value_bytes {
        return Err(over(
            "value",
            "max_value_bytes",
            record.value.len(),
            limits.max_value_bytes,
        ));
    }
    let header_bytes: usize = record
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    if header_bytes > limits.max_header_bytes {
        return Err(over(
            "headers",
            "max_header_bytes",
            header_bytes,
            limits.max_header_bytes,
        ));
    }
    // Sorted, so that with several reserved names the reported one is stable.
    if let Some(name) = record
        .headers
        .keys()
        .filter(|name| RESERVED_PREFIXES.iter().any(|prefix| name.starts_with(prefix)))
        .min()
    {
        return Err(RuntimeError::invalid_argument(
            format!("records[{index}].headers"),
            format!(
                "`{}` is in a namespace of the runtime (`taskstream.`, `__streams.`): client records \
                 may not carry it; rename the header",
                echo(name)
            ),
        ));
    }
    let timestamp_ms = match record.timestamp_ms {
        0 => None,
        t if t < 0 => {
            return Err(RuntimeError::invalid_argument(
                format!("records[{index}].timestamp_ms"),
                format!("{t} is negative; use milliseconds since the Unix epoch, or 0 for append time"),
            ));
        }
        t => Some(t),
    };
    let mut headers: Vec<(String, bytes::Bytes)> = record.headers.into_iter().collect();
    // A proto map has no order; sorting keeps stored records reproducible.
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(ProducerRecord {
        key: record.key,
        value: record.value,
        partition: record.partition,
        timestamp_ms,
        headers,
    })
}

/// A range Query page token: a version byte, the partition to resume (big-endian) and the
/// key to resume from (inclusive). Opaque to clients.
const PAGE_TOKEN_VERSION: u8 = 1;

pub fn page_token(resume: &RangeResume) -> bytes::Bytes {
    let mut token = Vec::with_capacity(5 + resume.key.len());
    token.push(PAGE_TOKEN_VERSION);
    token.extend_from_slice(&resume.partition.to_be_bytes());
    token.extend_from_slice(&resume.key);
    bytes::Bytes::from(token)
}

pub fn parse_page_token(token: &bytes::Bytes) -> Result<Option<RangeResume>, RuntimeError> {
    if token.is_empty() {
        return Ok(None);
    }
    match token.split_first() {
        Some((&PAGE_TOKEN_VERSION, rest)) if rest.len() >= 4 => {
            let (partition, _) = rest.split_at(4);
            let partition = u32::from_be_bytes([partition[0], partition[1], partition[2], partition[3]]);
            Ok(Some(RangeResume {
                partition,
                key: token.slice(5..),
            }))
        }
        _ => Err(RuntimeError::invalid_argument(
            "page_token",
            "is not a token this server gave; pass next_page_token of the previous answer as it is, \
             or leave it empty for the first page",
        )),
    }
}

/// A ReadTopic request as the runtime takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicReadArgs {
    pub topic: String,
    pub partition: u32,
    pub offset: u64,
    pub max_records: usize,
}

pub fn topic_read(request: pb::ReadTopicRequest) -> Result<TopicReadArgs, RuntimeError> {
    // Internal topics (retry, dead-letter) have longer names than the config allows for its own.
    check_name_up_to("topic", &request.topic, MAX_READ_TOPIC_LEN)?;
    let offset = u64::try_from(request.offset).map_err(|_| {
        RuntimeError::invalid_argument(
            "offset",
            format!("{} is negative; offsets start at 0", request.offset),
        )
    })?;
    let max_records = match request.max_records as usize {
        0 => DEFAULT_READ_RECORDS,
        max if max > MAX_READ_RECORDS => {
            return Err(RuntimeError::invalid_argument(
                "max_records",
                format!("{max} is more than {MAX_READ_RECORDS}; read in pages from the last offset + 1"),
            ));
        }
        max => max,
    };
    Ok(TopicReadArgs {
        topic: request.topic,
        partition: request.partition,
        offset,
        max_records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn field_of(error: RuntimeError) -> String {
        match error {
            RuntimeError::InvalidArgument { field, .. } => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    fn stream_request() -> pb::GetMetadataAsyncRequest {
        pb::GetMetadataAsyncRequest {
            store: "counts".into(),
            ..Default::default()
        }
    }

    #[test]
    fn unspecified_positions_mean_latest_and_open() {
        let stream = metadata_stream(pb::GetMetadataAsyncRequest {
            in_order: true,
            max_batch_records: 10,
            partitions: vec![1, 2],
            ..stream_request()
        })
        .unwrap();
        assert_eq!(stream.store, "counts");
        assert_eq!(stream.max_batch_records, 10);
        assert_eq!(
            stream.subscribe,
            SubscribeRequest {
                in_order: true,
                start: StartAt::Latest,
                end: EndAt::Open,
                partitions: vec![1, 2],
            }
        );
    }

    #[test]
    fn explicit_positions_and_offsets_translate() {
        let stream = metadata_stream(pb::GetMetadataAsyncRequest {
            start: pb::StartPosition::Offsets as i32,
            start_offsets: HashMap::from([(0, 5), (3, 0)]),
            end: pb::EndPosition::Offsets as i32,
            end_offsets: HashMap::from([(0, 50), (3, 7)]),
            ..stream_request()
        })
        .unwrap();
        assert_eq!(
            stream.subscribe.start,
            StartAt::Offsets(BTreeMap::from([(0, 5), (3, 0)]))
        );
        assert_eq!(
            stream.subscribe.end,
            EndAt::Offsets(BTreeMap::from([(0, 50), (3, 7)]))
        );

        let stream = metadata_stream(pb::GetMetadataAsyncRequest {
            start: pb::StartPosition::Earliest as i32,
            end: pb::EndPosition::Current as i32,
            ..stream_request()
        })
        .unwrap();
        assert_eq!(stream.subscribe.start, StartAt::Earliest);
        assert_eq!(stream.subscribe.end, EndAt::Current);
    }

    #[test]
    fn empty_or_malformed_store_is_rejected_on_store() {
        for store in ["", "has space", "slash/ed"] {
            let error = metadata_stream(pb::GetMetadataAsyncRequest {
                store: store.into(),
                ..Default::default()
            })
            .unwrap_err();
            assert_eq!(field_of(error), "store", "{store:?}");
        }
        assert_eq!(field_of(check_store(&"x".repeat(201)).unwrap_err()), "store");
        check_store("my-app.counts_v2").unwrap();
    }

    #[test]
    fn negative_offsets_are_rejected_with_their_partition() {
        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            start: pb::StartPosition::Offsets as i32,
            start_offsets: HashMap::from([(2, 0), (4, -1)]),
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "start_offsets[4]");

        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            end: pb::EndPosition::Offsets as i32,
            end_offsets: HashMap::from([(1, -10)]),
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "end_offsets[1]");
    }

    #[test]
    fn offsets_position_needs_offsets_and_offsets_need_the_position() {
        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            start: pb::StartPosition::Offsets as i32,
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "start_offsets");

        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            start_offsets: HashMap::from([(0, 1)]),
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "start_offsets");

        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            end: pb::EndPosition::Offsets as i32,
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "end_offsets");

        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            end: pb::EndPosition::Current as i32,
            end_offsets: HashMap::from([(0, 1)]),
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "end_offsets");
    }

    #[test]
    fn unknown_enum_values_are_rejected() {
        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            start: 42,
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "start");
        let error = metadata_stream(pb::GetMetadataAsyncRequest {
            end: -1,
            ..stream_request()
        })
        .unwrap_err();
        assert_eq!(field_of(error), "end");
    }

    #[test]
    fn query_needs_a_key_or_a_range() {
        let request = pb::QueryRequest {
            store: "counts".into(),
            ..Default::default()
        };
        assert_eq!(field_of(store_query(request.clone()).unwrap_err()), "query");

        let key = |key: &'static [u8]| pb::QueryRequest {
            query: Some(pb::query_request::Query::Key(pb::KeyQuery {
                key: Bytes::from_static(key),
            })),
            ..request.clone()
        };
        // The empty key is a key, as in Kafka.
        assert_eq!(
            store_query(key(b"")).unwrap().query,
            StoreQuery::Key(Bytes::new())
        );
        assert_eq!(
            store_query(key(b"k1")).unwrap(),
            QueryArgs {
                store: "counts".to_string(),
                query: StoreQuery::Key(Bytes::from_static(b"k1")),
                local_only: false,
            }
        );
        assert!(
            store_query(pb::QueryRequest {
                local_only: true,
                ..key(b"k1")
            })
            .unwrap()
            .local_only
        );

        let range = |from: Option<&'static [u8]>, to: Option<&'static [u8]>| pb::QueryRequest {
            query: Some(pb::query_request::Query::Range(pb::RangeQuery {
                from: from.map(Bytes::from_static),
                to: to.map(Bytes::from_static),
            })),
            partitions: vec![1],
            limit: 5,
            ..request.clone()
        };
        assert_eq!(
            field_of(store_query(range(Some(b"b"), Some(b"a"))).unwrap_err()),
            "range"
        );
        assert_eq!(
            store_query(range(None, Some(b"m"))).unwrap().query,
            StoreQuery::Range {
                from: None,
                to: Some(Bytes::from_static(b"m")),
                partitions: vec![1],
                limit: 5,
                resume: None,
            }
        );
        let resume = RangeResume {
            partition: 4,
            key: Bytes::from_static(b"next"),
        };
        let page = store_query(pb::QueryRequest {
            page_token: page_token(&resume),
            ..range(None, None)
        })
        .unwrap();
        assert!(matches!(page.query, StoreQuery::Range { resume: Some(r), .. } if r == resume));
        let error = store_query(pb::QueryRequest {
            page_token: Bytes::from_static(b"forged"),
            ..range(None, None)
        })
        .unwrap_err();
        assert_eq!(field_of(error), "page_token");

        let error = store_query(pb::QueryRequest {
            store: String::new(),
            ..key(b"k")
        })
        .unwrap_err();
        assert_eq!(field_of(error), "store");
    }

    fn limits() -> ProduceLimits {
        ProduceLimits::of(&Config::default())
    }

    #[test]
    fn produce_limits_name_their_setting() {
        let small = ProduceLimits {
            max_records: 2,
            max_key_bytes: 4,
            max_value_bytes: 8,
            max_header_bytes: 6,
        };
        let record = |key: &'static [u8], value: &'static [u8], header: &'static [u8]| pb::ProducerRecord {
            key: Some(Bytes::from_static(key)),
            value: Bytes::from_static(value),
            headers: HashMap::from([("h".to_string(), Bytes::from_static(header))]),
            ..Default::default()
        };
        let produce = |records| {
            produce_batch(
                pb::ProduceRequest {
                    topic: "events".into(),
                    records,
                },
                small,
            )
        };
        let setting_of = |error: RuntimeError| match error {
            RuntimeError::LimitExceeded { setting, .. } => setting,
            other => panic!("expected LimitExceeded, got {other:?}"),
        };
        produce(vec![record(b"kkkk", b"vvvvvvvv", b"hhhhh")]).unwrap();
        assert_eq!(
            setting_of(produce(vec![record(b"k", b"v", b"h"); 3]).unwrap_err()),
            "max_records_per_produce"
        );
        assert_eq!(
            setting_of(produce(vec![record(b"kkkkk", b"v", b"h")]).unwrap_err()),
            "max_key_bytes"
        );
        assert_eq!(
            setting_of(produce(vec![record(b"k", b"vvvvvvvvv", b"h")]).unwrap_err()),
            "max_value_bytes"
        );
        assert_eq!(
            setting_of(produce(vec![record(b"k", b"v", b"hhhhhh")]).unwrap_err()),
            "max_header_bytes"
        );
    }

    #[test]
    fn produce_checks_topic_and_timestamps() {
        let error = produce_batch(pb::ProduceRequest::default(), limits()).unwrap_err();
        assert_eq!(field_of(error), "topic");

        let error = produce_batch(
            pb::ProduceRequest {
                topic: "events".into(),
                records: vec![
                    pb::ProducerRecord::default(),
                    pb::ProducerRecord {
                        timestamp_ms: -5,
                        ..Default::default()
                    },
                ],
            },
            limits(),
        )
        .unwrap_err();
        assert_eq!(field_of(error), "records[1].timestamp_ms");

        let (topic, records) = produce_batch(
            pb::ProduceRequest {
                topic: "events".into(),
                records: vec![
                    pb::ProducerRecord {
                        key: Some(Bytes::from_static(b"k")),
                        value: Bytes::from_static(b"v"),
                        partition: Some(3),
                        timestamp_ms: 1_700_000_000_000,
                        headers: HashMap::from([
                            ("b".to_string(), Bytes::from_static(b"2")),
                            ("a".to_string(), Bytes::from_static(b"1")),
                        ]),
                    },
                    pb::ProducerRecord {
                        value: Bytes::from_static(b"w"),
                        ..Default::default()
                    },
                ],
            },
            limits(),
        )
        .unwrap();
        assert_eq!(topic, "events");
        assert_eq!(
            records,
            vec![
                ProducerRecord {
                    key: Some(Bytes::from_static(b"k")),
                    value: Bytes::from_static(b"v"),
                    partition: Some(3),
                    timestamp_ms: Some(1_700_000_000_000),
                    headers: vec![
                        ("a".to_string(), Bytes::from_static(b"1")),
                        ("b".to_string(), Bytes::from_static(b"2")),
                    ],
                },
                ProducerRecord {
                    value: Bytes::from_static(b"w"),
                    ..Default::default()
                },
            ]
        );
    }

    #[test]
    fn topic_read_defaults_and_bounds() {
        let request = |offset, max_records| pb::ReadTopicRequest {
            topic: "app-counts-dlq".into(),
            partition: 3,
            offset,
            max_records,
        };
        assert_eq!(
            topic_read(request(7, 0)).unwrap(),
            TopicReadArgs {
                topic: "app-counts-dlq".into(),
                partition: 3,
                offset: 7,
                max_records: DEFAULT_READ_RECORDS,
            }
        );
        assert_eq!(
            topic_read(request(0, MAX_READ_RECORDS as u32))
                .unwrap()
                .max_records,
            MAX_READ_RECORDS
        );
        assert_eq!(field_of(topic_read(request(-1, 0)).unwrap_err()), "offset");
        assert_eq!(
            field_of(topic_read(request(0, MAX_READ_RECORDS as u32 + 1)).unwrap_err()),
            "max_records"
        );
        for topic in ["", "has space"] {
            let error = topic_read(pb::ReadTopicRequest {
                topic: topic.into(),
                ..request(0, 0)
            })
            .unwrap_err();
            assert_eq!(field_of(error), "topic", "{topic:?}");
        }
        // The retry topic of the longest application id and pipeline name is readable.
        let longest = format!("{}-{}-retry", "a".repeat(200), "p".repeat(200));
        topic_read(pb::ReadTopicRequest {
            topic: longest,
            ..request(0, 0)
        })
        .unwrap();
    }
}
