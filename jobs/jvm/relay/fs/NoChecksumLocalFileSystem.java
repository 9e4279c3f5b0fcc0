package relay.fs;

import java.io.IOException;
import java.net.URI;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.LocalFileSystem;

/**
 * The local file system without Hadoop's ".crc" side files: each checkpoint log write is one
 * file and one rename instead of two (~50 ms less per micro-batch on 2 cores). A subclass of
 * LocalFileSystem, not RawLocalFileSystem, because Spark's RocksDB state store asks Hadoop for
 * "the" LocalFileSystem (FileSystem.getLocal) and casts what it gets.
 */
public class NoChecksumLocalFileSystem extends LocalFileSystem {
    @Override
    public void initialize(URI name, Configuration conf) throws IOException {
        super.initialize(name, conf);
        setWriteChecksum(false);
        setVerifyChecksum(false);
    }
}
