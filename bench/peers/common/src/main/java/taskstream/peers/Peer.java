package taskstream.peers;

import java.util.Locale;

/**
 * The frame of every peer of bench scenario `peers`: each reads the topic the harness wrote once
 * (value: the record's drawn latency in microseconds, ASCII), "processes" a record by sleeping its
 * latency, and prints one line
 * {@code PEER_RESULT seconds=… records=… duplicates=… cpu_seconds=… startup_seconds=…
 * partition_spread_seconds=… finished=…}
 * timed from the first record handed to processing until every record is processed.
 *
 * <p>Arguments of every peer's main: {@code MODE BOOTSTRAP TOPIC RECORDS CONCURRENCY}.
 */
public final class Peer {
    private Peer() {}

    /** What a peer is given. */
    public record Args(String mode, String bootstrap, String topic, int records, int concurrency, long timeoutSeconds) {
        /** A group / application id no other run on the broker has. */
        public String uniqueId(String system) {
            return "peer-" + system + "-" + mode + "-" + topic + "-" + ProcessHandle.current().pid();
        }
    }

    /** Runs the peer until every record is processed, a failure, or the timeout; then stops it. */
    @FunctionalInterface
    public interface Runner {
        void run(Args args, Progress progress) throws Exception;
    }

    public static void main(String[] argv, Runner runner) {
        if (argv.length != 5) {
            System.err.println("usage: MODE BOOTSTRAP TOPIC RECORDS CONCURRENCY");
            System.exit(2);
        }
        Args args = new Args(argv[0], argv[1], argv[2], Integer.parseInt(argv[3]), Integer.parseInt(argv[4]),
                Long.getLong("peer.timeout.seconds", 600));
        Progress progress = new Progress(args.records());
        Progress.install(progress);
        try {
            runner.run(args, progress);
        } catch (Throwable e) {
            progress.fail(e);
        }
        boolean finished = progress.finished();
        if (progress.failure() != null) {
            System.err.println("peer failed:");
            progress.failure().printStackTrace();
        }
        System.out.println(String.format(Locale.ROOT,
                "PEER_RESULT seconds=%.6f records=%d duplicates=%d cpu_seconds=%.3f startup_seconds=%.3f partition_spread_seconds=%.3f finished=%b",
                progress.seconds(), progress.distinct(), progress.duplicates(), progress.cpuSeconds(),
                progress.startupSeconds(), progress.partitionSpreadSeconds(), finished));
        System.out.flush();
        // Library threads (Flink's mini-cluster, Kafka clients) must not keep the JVM alive.
        System.exit(finished ? 0 : 1);
    }
}
