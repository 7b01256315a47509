package taskstream.peers;

import java.lang.management.ManagementFactory;
import java.util.HashSet;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.locks.LockSupport;

/**
 * What every peer measures, the same way: the first record handed to processing starts the
 * clock, and the last distinct (partition, offset) processed stops it. One per JVM (Flink's
 * mini-cluster runs the job's functions in this JVM, so they reach it through {@link #get()}).
 */
public final class Progress {
    private static volatile Progress instance;

    private final int records;
    private final long created = System.nanoTime();
    private final AtomicLong firstNanos = new AtomicLong();
    private volatile long firstCpuNanos;
    /** Each partition's first record (nanoTime): how far apart the partitions started. */
    private final ConcurrentHashMap<Integer, Long> firstByPartition = new ConcurrentHashMap<>();
    private final Set<Long> seen = new HashSet<>();
    private long duplicates;
    private long doneNanos;
    private long doneCpuNanos;
    private volatile Throwable failure;
    private final CountDownLatch done = new CountDownLatch(1);

    Progress(int records) {
        this.records = records;
    }

    static void install(Progress progress) {
        instance = progress;
    }

    public static Progress get() {
        return instance;
    }

    /** A record of `partition` is handed to processing: the first one starts the clock. */
    public void begin(int partition) {
        firstByPartition.computeIfAbsent(partition, p -> System.nanoTime());
        if (firstNanos.get() == 0) {
            long cpu = processCpuNanos();
            if (firstNanos.compareAndSet(0, System.nanoTime())) {
                firstCpuNanos = cpu;
            }
        }
    }

    /** A record is processed; the last distinct one stops the clock. */
    public synchronized void completed(int partition, long offset) {
        if (!seen.add(((long) partition << 40) | offset)) {
            duplicates++;
            return;
        }
        if (seen.size() == records) {
            doneNanos = System.nanoTime();
            doneCpuNanos = processCpuNanos();
            done.countDown();
        }
    }

    /** The peer failed: the wait ends, unfinished. */
    public void fail(Throwable cause) {
        if (failure == null) {
            failure = cause;
        }
        done.countDown();
    }

    public Throwable failure() {
        return failure;
    }

    /** Waits up to `seconds` for every record or a failure; whether every record is processed. */
    public boolean await(long seconds) throws InterruptedException {
        return done.await(seconds, TimeUnit.SECONDS) && finished();
    }

    public synchronized boolean finished() {
        return seen.size() == records;
    }

    public synchronized double seconds() {
        long end = doneNanos != 0 ? doneNanos : System.nanoTime();
        long start = firstNanos.get();
        return start == 0 ? 0 : (end - start) / 1e9;
    }

    public synchronized int distinct() {
        return seen.size();
    }

    public synchronized long duplicates() {
        return duplicates;
    }

    /** This JVM's CPU time over the measured span. */
    public synchronized double cpuSeconds() {
        long end = doneCpuNanos != 0 ? doneCpuNanos : processCpuNanos();
        return firstNanos.get() == 0 ? 0 : (end - firstCpuNanos) / 1e9;
    }

    /** From the first record to the first record of the partition that started last. */
    public double partitionSpreadSeconds() {
        long start = firstNanos.get();
        long last = firstByPartition.values().stream().mapToLong(Long::longValue).max().orElse(start);
        return start == 0 ? 0 : Math.max(0, last - start) / 1e9;
    }

    /** From the start of `main` to the first record (client start and group join). */
    public double startupSeconds() {
        long start = firstNanos.get();
        return start == 0 ? 0 : (start - created) / 1e9;
    }

    /** The "processing": sleeps `micros` (parkNanos: Java 17's Thread.sleep rounds to whole ms). */
    public static void sleepMicros(long micros) {
        long deadline = System.nanoTime() + micros * 1000;
        for (long left = micros * 1000; left > 0; left = deadline - System.nanoTime()) {
            LockSupport.parkNanos(left);
        }
    }

    /** A record's value: its drawn latency in microseconds (ASCII decimal). */
    public static long micros(String value) {
        return Long.parseLong(value.trim());
    }

    private static long processCpuNanos() {
        var os = ManagementFactory.getOperatingSystemMXBean();
        if (os instanceof com.sun.management.OperatingSystemMXBean sun) {
            return sun.getProcessCpuTime();
        }
        return 0;
    }
}
