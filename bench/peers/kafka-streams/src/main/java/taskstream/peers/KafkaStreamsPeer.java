package taskstream.peers;

import java.nio.file.Files;
import java.time.Duration;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.errors.StreamsUncaughtExceptionHandler.StreamThreadExceptionResponse;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.processor.api.Processor;
import org.apache.kafka.streams.processor.api.ProcessorContext;
import org.apache.kafka.streams.processor.api.Record;
import org.apache.kafka.streams.processor.api.RecordMetadata;

/**
 * Kafka Streams 4.x: one task per partition, each run by one stream thread at a time (MODE is
 * ignored; CONCURRENCY = num.stream.threads). A stateless topology: source, then a processor
 * that sleeps each record's latency.
 */
public final class KafkaStreamsPeer {
    private KafkaStreamsPeer() {}

    public static void main(String[] argv) {
        Peer.main(argv, KafkaStreamsPeer::run);
    }

    static void run(Peer.Args args, Progress progress) throws Exception {
        Properties props = new Properties();
        props.put(StreamsConfig.APPLICATION_ID_CONFIG, args.uniqueId("kstreams"));
        props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, args.bootstrap());
        props.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, args.concurrency());
        props.put(StreamsConfig.STATE_DIR_CONFIG, Files.createTempDirectory("peer-kstreams").toString());
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        StreamsBuilder builder = new StreamsBuilder();
        builder.stream(args.topic(), Consumed.with(Serdes.ByteArray(), Serdes.String()))
                .process(() -> new Processor<byte[], String, byte[], String>() {
                    private ProcessorContext<byte[], String> context;

                    @Override
                    public void init(ProcessorContext<byte[], String> context) {
                        this.context = context;
                    }

                    @Override
                    public void process(Record<byte[], String> record) {
                        RecordMetadata where = context.recordMetadata().orElseThrow();
                        progress.begin(where.partition());
                        Progress.sleepMicros(Progress.micros(record.value()));
                        progress.completed(where.partition(), where.offset());
                    }
                });
        KafkaStreams streams = new KafkaStreams(builder.build(), props);
        streams.setUncaughtExceptionHandler(e -> {
            progress.fail(e);
            return StreamThreadExceptionResponse.SHUTDOWN_CLIENT;
        });
        streams.start();
        try {
            progress.await(args.timeoutSeconds());
        } finally {
            streams.close(Duration.ofSeconds(30));
            streams.cleanUp();
        }
    }
}
