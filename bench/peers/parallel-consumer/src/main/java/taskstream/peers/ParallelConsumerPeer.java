package taskstream.peers;

import io.confluent.parallelconsumer.ParallelConsumerOptions;
import io.confluent.parallelconsumer.ParallelConsumerOptions.CommitMode;
import io.confluent.parallelconsumer.ParallelConsumerOptions.ProcessingOrder;
import io.confluent.parallelconsumer.ParallelStreamProcessor;
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.StringDeserializer;

/**
 * Confluent Parallel Consumer with MODE = PARTITION, KEY or UNORDERED and CONCURRENCY =
 * maxConcurrency; offsets committed periodically and asynchronously (its default).
 */
public final class ParallelConsumerPeer {
    private ParallelConsumerPeer() {}

    public static void main(String[] argv) {
        Peer.main(argv, ParallelConsumerPeer::run);
    }

    static void run(Peer.Args args, Progress progress) throws Exception {
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, args.bootstrap());
        props.put(ConsumerConfig.GROUP_ID_CONFIG, args.uniqueId("pc"));
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        KafkaConsumer<byte[], String> consumer =
                new KafkaConsumer<>(props, new ByteArrayDeserializer(), new StringDeserializer());
        ParallelConsumerOptions<byte[], String> options = ParallelConsumerOptions.<byte[], String>builder()
                .ordering(ProcessingOrder.valueOf(args.mode()))
                .maxConcurrency(args.concurrency())
                .consumer(consumer)
                .commitMode(CommitMode.PERIODIC_CONSUMER_ASYNCHRONOUS)
                .build();
        ParallelStreamProcessor<byte[], String> pc = ParallelStreamProcessor.createEosStreamProcessor(options);
        pc.subscribe(List.of(args.topic()));
        pc.poll(context -> {
            ConsumerRecord<byte[], String> record = context.getSingleConsumerRecord();
            progress.begin(record.partition());
            Progress.sleepMicros(Progress.micros(record.value()));
            progress.completed(record.partition(), record.offset());
        });
        long deadline = System.nanoTime() + args.timeoutSeconds() * 1_000_000_000L;
        try {
            // PC's control thread fails on its own (closing itself): check for that every second.
            while (!progress.await(1) && progress.failure() == null && System.nanoTime() < deadline) {
                if (pc.isClosedOrFailed()) {
                    progress.fail(new IllegalStateException("Parallel Consumer closed or failed"));
                }
            }
        } finally {
            pc.close();
        }
    }
}
