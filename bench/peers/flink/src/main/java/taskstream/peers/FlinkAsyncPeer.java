package taskstream.peers;

import java.nio.charset.StandardCharsets;
import java.util.Collections;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.RestOptions;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.streaming.api.datastream.AsyncDataStream;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.async.ResultFuture;
import org.apache.flink.streaming.api.functions.async.RichAsyncFunction;
import org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.consumer.ConsumerRecord;

/**
 * Flink's async I/O in a local mini-cluster (MODE = ordered or unordered, CONCURRENCY = the
 * async operator's capacity): a bounded Kafka source (from the earliest offset to the end at
 * start; parallelism 1 for the one partition), AsyncDataStream.orderedWait / unorderedWait, each
 * call sleeping on a pool as wide as the capacity; records are counted where the async operator
 * emits them.
 */
public final class FlinkAsyncPeer {
    private FlinkAsyncPeer() {}

    /** (partition, offset, latency µs). */
    private static final TypeInformation<Tuple3<Integer, Long, Long>> ITEM =
            Types.TUPLE(Types.INT, Types.LONG, Types.LONG);

    public static void main(String[] argv) {
        Peer.main(argv, FlinkAsyncPeer::run);
    }

    static void run(Peer.Args args, Progress progress) throws Exception {
        int capacity = args.concurrency();
        Configuration conf = new Configuration();
        // The mini-cluster's REST endpoint: loopback, a free port.
        conf.set(RestOptions.BIND_ADDRESS, "127.0.0.1");
        conf.set(RestOptions.BIND_PORT, "0");
        StreamExecutionEnvironment env = StreamExecutionEnvironment.createLocalEnvironment(1, conf);
        KafkaSource<Tuple3<Integer, Long, Long>> source = KafkaSource.<Tuple3<Integer, Long, Long>>builder()
                .setBootstrapServers(args.bootstrap())
                .setTopics(args.topic())
                .setGroupId(args.uniqueId("flink"))
                .setStartingOffsets(OffsetsInitializer.earliest())
                .setBounded(OffsetsInitializer.latest())
                .setDeserializer(new Deserializer())
                .build();
        DataStream<Tuple3<Integer, Long, Long>> records =
                env.fromSource(source, WatermarkStrategy.noWatermarks(), "kafka");
        DataStream<Tuple3<Integer, Long, Long>> slept = switch (args.mode()) {
            case "ordered" -> AsyncDataStream.orderedWait(
                    records, new Sleep(capacity), 600, TimeUnit.SECONDS, capacity);
            case "unordered" -> AsyncDataStream.unorderedWait(
                    records, new Sleep(capacity), 600, TimeUnit.SECONDS, capacity);
            default -> throw new IllegalArgumentException("flink mode: ordered or unordered, not " + args.mode());
        };
        slept.map(item -> {
                    Progress.get().completed(item.f0, item.f1);
                    return item.f1;
                })
                .returns(Types.LONG)
                .sinkTo(new DiscardingSink<>());
        // The source is bounded: the job ends once every record has passed.
        env.execute("peer-flink-" + args.mode());
    }

    private static final class Deserializer implements KafkaRecordDeserializationSchema<Tuple3<Integer, Long, Long>> {
        @Override
        public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Tuple3<Integer, Long, Long>> out) {
            String value = new String(record.value(), StandardCharsets.US_ASCII);
            out.collect(Tuple3.of(record.partition(), record.offset(), Progress.micros(value)));
        }

        @Override
        public TypeInformation<Tuple3<Integer, Long, Long>> getProducedType() {
            return ITEM;
        }
    }

    /** Sleeps each record's latency on a pool as wide as the operator's capacity. */
    private static final class Sleep
            extends RichAsyncFunction<Tuple3<Integer, Long, Long>, Tuple3<Integer, Long, Long>> {
        private final int threads;
        private transient ExecutorService pool;

        Sleep(int threads) {
            this.threads = threads;
        }

        @Override
        public void open(OpenContext context) {
            pool = Executors.newFixedThreadPool(threads);
        }

        @Override
        public void asyncInvoke(Tuple3<Integer, Long, Long> item, ResultFuture<Tuple3<Integer, Long, Long>> result) {
            Progress.get().begin(item.f0);
            pool.execute(() -> {
                Progress.sleepMicros(item.f2);
                result.complete(Collections.singleton(item));
            });
        }

        @Override
        public void close() {
            pool.shutdownNow();
        }
    }
}
