package relay.stream;

import java.nio.ByteBuffer;
import java.sql.Timestamp;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;

import org.apache.spark.api.java.function.MapFunction;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.streaming.ExpiredTimerInfo;
import org.apache.spark.sql.streaming.MapState;
import org.apache.spark.sql.streaming.OutputMode;
import org.apache.spark.sql.streaming.StatefulProcessorWithInitialState;
import org.apache.spark.sql.streaming.TTLConfig;
import org.apache.spark.sql.streaming.TimeMode;
import org.apache.spark.sql.streaming.TimerValues;
import org.apache.spark.sql.streaming.ValueState;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;

/**
 * The inbox stream's state, in Spark's state store: per (protocol, mailbox) the last cursor
 * (kept for ever: cursors never restart) and the event ids accepted within the dedup window
 * (the longest envelope TTL), with each id's expiry. The same rules as
 * jobs/inbox_transform.decide, which the tests hold this class to.
 *
 * <p>Expired ids are swept by one processing-time timer per mailbox, not by the state store's
 * TTL: a TTL on the map keeps a second RocksDB entry per id (its expiry index, keyed by time,
 * so with no key prefix shared between neighbours) and wraps each value with its own expiry,
 * which the value here already is. Measured at 5 M live ids, the TTL index was about half of
 * the state's bytes on disk, and those bytes are what a restart copies, compacts and looks up
 * through (docs/results/2026-12-02-stream-state.md). An id past its expiry that no sweep has
 * reached yet is never taken for live (`live` compares the expiry), so a late sweep costs disk,
 * never correctness. It is late by at most one step, or, for an id whose TTL is shorter than
 * that of the id its mailbox's pending sweep waits for, by at most the dedup window.
 *
 * <p>JVM code because a Python stateful function costs a Python call (and for
 * transformWithStateInPandas a socket round trip per state access) per mailbox per batch:
 * measured at ~2.5k rows/s against the stream's 100k target (docs/decisions/0008). Here a
 * batch's rows of one mailbox cost a sort, a RocksDB lookup and a write per accepted row, and
 * two lookups (the cursor, the pending sweep) and a write per mailbox.
 *
 * <p>Deterministic, so a batch replayed after a crash yields the same rows: the rows of a
 * mailbox are ordered by (received_at, landing_table, landing_version, event_id, envelope,
 * meta), as jobs/inbox_transform.ARRIVAL orders a batch, and "now" is
 * the micro-batch's timestamp from Spark's offset log. Each input row comes out once, with its
 * cursor (accepted) or its reason (duplicate, expired, oversize), and the batch time.
 *
 * <p>A new checkpoint over an inbox that has rows starts from an initial state read from the
 * inbox once (jobs/stream_state.seed): rows (protocol, mailbox, event_id, value), a null
 * event id carrying the mailbox's last cursor, others a live event id and its expiry. A
 * restart from the checkpoint restores the state store and reads no inbox row.
 */
public final class MailboxState extends StatefulProcessorWithInitialState<Row, Row, Row, Row> {
    private static final long serialVersionUID = 1L;

    private final long dedupWindowMs;
    private final Map<String, Long> maxEnvelope;
    private final Map<String, Long> firstCursor;
    private transient ValueState<Long> cursor;
    private transient MapState<byte[], Long> seen;
    private transient ValueState<Long> sweepAt;

    /**
     * Sweeps are rounded up to this step, so a busy mailbox keeps one timer, moved rarely: a
     * sixteenth of the dedup window, between one second and one minute.
     */
    private final long sweepStepMs;

    public MailboxState(long dedupWindowMs, Map<String, Long> maxEnvelope, Map<String, Long> firstCursor) {
        this.dedupWindowMs = dedupWindowMs;
        this.maxEnvelope = maxEnvelope;
        this.firstCursor = firstCursor;
        this.sweepStepMs = Math.max(1_000L, Math.min(60_000L, dedupWindowMs / 16));
    }


    @Override
    public void init(OutputMode outputMode, TimeMode timeMode) {
        cursor = getHandle().getValueState("cursor", Encoders.LONG(), TTLConfig.NONE());
        seen = getHandle().getMapState("seen", Encoders.BINARY(), Encoders.LONG(), TTLConfig.NONE());
        sweepAt = getHandle().getValueState("sweep_at", Encoders.LONG(), TTLConfig.NONE());
    }

    /** When to sweep an id expiring at `expiresUs`: its expiry in ms, rounded up to a step. */
    private long sweepDue(long expiresUs) {
        long ms = expiresUs / 1_000L;
        return Math.floorDiv(ms + sweepStepMs - 1, sweepStepMs) * sweepStepMs;
    }

    /** A sweep due by `due` unless the mailbox has one pending already (one lookup). */
    private void sweepBy(long due) {
        if (sweepAt.get() == null) {
            getHandle().registerTimer(due);
            sweepAt.update(due);
        }
    }

    /**
     * The mailbox's sweep: forget the ids whose envelopes have expired, and come back when the
     * next one does (rounded up to a step; at least one step on). A mailbox with no live id
     * left keeps only its cursor.
     */
    @Override
    public scala.collection.Iterator<Row> handleExpiredTimer(Row key, TimerValues timerValues,
                                                             ExpiredTimerInfo expired) {
        long nowMs = timerValues.getCurrentProcessingTimeInMs();
        long nowUs = nowMs * 1_000L;
        List<byte[]> gone = new ArrayList<>();
        long next = Long.MAX_VALUE;
        scala.collection.Iterator<scala.Tuple2<byte[], Long>> it = seen.iterator();
        while (it.hasNext()) {
            scala.Tuple2<byte[], Long> e = it.next();
            if (e._2() <= nowUs) gone.add(e._1());
            else next = Math.min(next, e._2());
        }
        for (byte[] id : gone) seen.removeKey(id);
        if (next == Long.MAX_VALUE) {
            sweepAt.clear();
        } else {
            long due = Math.max(sweepDue(next), nowMs + sweepStepMs);
            getHandle().registerTimer(due);
            sweepAt.update(due);
        }
        return scala.collection.Iterator.empty();
    }

    @Override
    public void handleInitialState(Row key, Row seed, TimerValues timerValues) {
        Object eventId = seed.get(2);
        long value = seed.getLong(3);
        if (eventId == null) {
            Long had = cursor.get();
            if (had == null || had < value) cursor.update(value);
        } else {
            seen.updateValue((byte[]) eventId, value);
            sweepBy(sweepDue(value));
        }
    }

    static long micros(Object ts) {
        if (ts instanceof Instant) {
            Instant i = (Instant) ts;
            return i.getEpochSecond() * 1_000_000L + i.getNano() / 1_000;
        }
        Timestamp t = (Timestamp) ts;
        return Math.floorDiv(t.getTime(), 1000L) * 1_000_000L + t.getNanos() / 1_000;
    }

    /** The arrival order the cursors follow (class comment). */
    static final class Arrival implements Comparator<Row>, java.io.Serializable {
        private final int received, table, version, eventId, envelope, meta;

        Arrival(StructType schema) {
            received = schema.fieldIndex("received_at");
            table = schema.fieldIndex("landing_table");
            version = schema.fieldIndex("landing_version");
            eventId = schema.fieldIndex("event_id");
            envelope = schema.fieldIndex("envelope");
            meta = schema.fieldIndex("meta");
        }

        @Override
        public int compare(Row a, Row b) {
            int c = Long.compare(micros(a.get(received)), micros(b.get(received)));
            if (c != 0) return c;
            c = a.getString(table).compareTo(b.getString(table));
            if (c != 0) return c;
            c = Long.compare(a.getLong(version), b.getLong(version));
            if (c != 0) return c;
            c = Arrays.compareUnsigned((byte[]) a.get(eventId), (byte[]) b.get(eventId));
            if (c != 0) return c;
            c = Arrays.compareUnsigned((byte[]) a.get(envelope), (byte[]) b.get(envelope));
            if (c != 0) return c;
            return Arrays.compareUnsigned((byte[]) a.get(meta), (byte[]) b.get(meta));
        }
    }

    @Override
    public scala.collection.Iterator<Row> handleInputRows(Row key, scala.collection.Iterator<Row> input,
                                                          TimerValues timerValues) {
        List<Row> rows = new ArrayList<>();
        while (input.hasNext()) rows.add(input.next());
        if (rows.isEmpty()) return scala.collection.Iterator.empty();
        StructType schema = rows.get(0).schema();
        rows.sort(new Arrival(schema));
        int eventIdAt = schema.fieldIndex("event_id");
        int envelopeAt = schema.fieldIndex("envelope");
        int expiresAt = schema.fieldIndex("expires_at");
        int receivedAt = schema.fieldIndex("received_at");
        int width = schema.size();

        long nowMs = timerValues.getCurrentProcessingTimeInMs();
        long nowUs = nowMs * 1_000L;
        String protocol = key.getString(0);
        long limit = maxEnvelope.getOrDefault(protocol, Long.MAX_VALUE);
        Long had = cursor.get();      // null when absent: one lookup, not exists() then get()
        long last = had != null ? had : firstCursor.getOrDefault(protocol, 1L) - 1;
        long earliest = Long.MAX_VALUE;
        long start = last;
        HashSet<ByteBuffer> batch = new HashSet<>();
        List<Row> out = new ArrayList<>(rows.size());
        for (Row r : rows) {
            byte[] eventId = (byte[]) r.get(eventIdAt);
            long expires = micros(r.get(expiresAt));
            String reason = null;
            Long assigned = null;
            if (((byte[]) r.get(envelopeAt)).length > limit) {
                reason = "oversize";
            } else if (expires <= nowUs) {
                reason = "expired";
            } else if (!batch.add(ByteBuffer.wrap(eventId)) || live(eventId, nowUs)) {
                reason = "duplicate";
            } else {
                assigned = ++last;
                // remembered until its clamped expiry (the inbox's), as the TTL clamp has it
                long until = Math.min(expires, micros(r.get(receivedAt)) + dedupWindowMs * 1_000L);
                seen.updateValue(eventId, until);
                earliest = Math.min(earliest, until);
            }
            Object[] values = new Object[width + 3];
            for (int i = 0; i < width; i++) values[i] = r.get(i);
            values[width] = assigned;
            values[width + 1] = reason;
            values[width + 2] = nowMs;
            out.add(RowFactory.create(values));
        }
        if (last != start) {
            cursor.update(last);
            sweepBy(sweepDue(earliest));
        }
        return scala.jdk.javaapi.CollectionConverters.asScala(out.iterator());
    }

    /** An id accepted earlier whose envelope has not expired: a retry after expiry is new. */
    private boolean live(byte[] eventId, long nowUs) {
        Long expires = seen.getValue(eventId);
        return expires != null && expires > nowUs;
    }

    static Map<String, Long> parse(String spec) {
        Map<String, Long> m = new HashMap<>();
        if (spec == null || spec.isEmpty()) return m;
        for (String part : spec.split(",")) {
            String[] kv = part.split("=", 2);
            m.put(kv[0], Long.parseLong(kv[1]));
        }
        return m;
    }

    /**
     * `landing` with each row's cursor or reject reason: the state keyed by (protocol,
     * mailbox). The maps are "protocol=value,..." so that Python passes plain strings.
     */
    public static Dataset<Row> apply(Dataset<Row> landing, long dedupWindowMs, String maxEnvelope,
                                     String firstCursor, Dataset<Row> seed) {
        StructType in = landing.schema();
        StructType keySchema = new StructType()
                .add("protocol", DataTypes.StringType, false)
                .add("mailbox", DataTypes.BinaryType, false);
        StructType outSchema = in
                .add("cursor", DataTypes.LongType, true)
                .add("reason", DataTypes.StringType, true)
                .add("batch_ms", DataTypes.LongType, false);
        int p = in.fieldIndex("protocol");
        int m = in.fieldIndex("mailbox");
        MapFunction<Row, Row> keyOf = r -> RowFactory.create(r.getString(p), r.get(m));
        MapFunction<Row, Row> seedKey = r -> RowFactory.create(r.getString(0), r.get(1));
        return landing
                .groupByKey(keyOf, Encoders.row(keySchema))
                .transformWithState(new MailboxState(dedupWindowMs, parse(maxEnvelope), parse(firstCursor)),
                        TimeMode.ProcessingTime(), OutputMode.Append(),
                        seed.groupByKey(seedKey, Encoders.row(keySchema)),
                        Encoders.row(outSchema), Encoders.row(seed.schema()));
    }
}
