//! `taskstream read`: every partition of a topic in turn (or the one `--partition`
//! names), each with one ReadTopic call, or, without `--from`, a read from the
//! oldest retained offset, which the client has to learn first (an offset below
//! it is OUT_OF_RANGE by contract).

use taskstream_client::{ClientError, StreamsClient, v1};

/// Times a read from the start is asked again when retention moved the start
/// past it between the calls; more than a couple means something else is wrong.
const START_RETRIES: u32 = 3;

pub struct ReadInput {
    pub topic: String,
    /// `None`: every partition, in order.
    pub partition: Option<u32>,
    /// `None`: from the oldest retained offset.
    pub from: Option<i64>,
    /// 0 = the server's default.
    pub max_records: u32,
}

/// One answer per partition read, in partition order. Without `--partition`
/// the first answer (partition 0) tells how many partitions there are.
pub async fn run(
    client: &StreamsClient,
    input: ReadInput,
) -> Result<Vec<v1::ReadTopicResponse>, ClientError> {
    if let Some(partition) = input.partition {
        return Ok(vec![read_partition(client, &input, partition).await?]);
    }
    let first = read_partition(client, &input, 0).await?;
    let mut answers = Vec::with_capacity(first.partitions.max(1) as usize);
    let partitions = first.partitions;
    answers.push(first);
    for partition in 1..partitions {
        answers.push(read_partition(client, &input, partition).await?);
    }
    Ok(answers)
}

async fn read_partition(
    client: &StreamsClient,
    input: &ReadInput,
    partition: u32,
) -> Result<v1::ReadTopicResponse, ClientError> {
    let read = |offset| client.read_topic(&input.topic, partition, offset, input.max_records);
    if let Some(from) = input.from {
        return read(from).await;
    }
    // Most topics still hold offset 0: one call. Otherwise an offset past any
    // end reads nothing but answers the start offset, and the read goes from there.
    let mut offset = 0;
    let mut retries = 0;
    loop {
        match read(offset).await {
            Err(ClientError::OutOfRange { .. }) if retries < START_RETRIES => {
                retries += 1;
                offset = client
                    .read_topic(&input.topic, partition, i64::MAX, 1)
                    .await?
                    .start_offset;
            }
            result => return result,
        }
    }
}
