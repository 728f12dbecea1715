package dstl.minidfs;

import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.BlockLocation;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.hdfs.DFSConfigKeys;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.hdfs.protocol.HdfsConstants;
import org.apache.hadoop.hdfs.server.datanode.DataNode;

/**
 * A MiniDFSCluster (one NameNode and N DataNodes in this JVM) for DSTL's HDFS tests and
 * benchmarks.
 *
 * <p>Arguments: {@code --dir DIR} (the cluster's storage, created), {@code --datanodes N}
 * (default 2), {@code --replication N} (the default replication of new files, default 1),
 * {@code --rpc-port P} and {@code --http-port P} (0, the default: free ports chosen by the
 * operating system), {@code --webhdfs true|false} (WebHDFS on the HTTP port, default false),
 * {@code --conf KEY=VALUE} (any Hadoop setting, repeatable; applied last).
 *
 * <p>Once the cluster is up it prints one line {@code ready rpc=<port> http=<port>} to stdout.
 * It then reads commands from stdin, one a line, and answers each with one line starting with
 * {@code ok} or {@code error}:
 * <ul>
 *   <li>{@code stop-namenode}, {@code start-namenode} (same ports), {@code restart-namenode};</li>
 *   <li>{@code stop-datanode I} (the I-th running DataNode), {@code stop-datanode-of PATH}
 *       (the one holding the first replica of the file's first block), {@code start-datanodes}
 *       (every stopped one again, same ports and storage);</li>
 *   <li>{@code safemode enter|leave};</li>
 *   <li>{@code ports} (the ready line again).</li>
 * </ul>
 * It shuts the cluster down and exits when stdin closes (the parent went away) or on
 * {@code quit}.
 */
public final class MiniDfs {
    private final MiniDFSCluster cluster;
    private final List<MiniDFSCluster.DataNodeProperties> stopped = new ArrayList<>();

    private MiniDfs(MiniDFSCluster cluster) {
        this.cluster = cluster;
    }

    public static void main(String[] args) throws Exception {
        String dir = null;
        int datanodes = 2;
        int replication = 1;
        int rpcPort = 0;
        int httpPort = 0;
        boolean webhdfs = false;
        List<String> settings = new ArrayList<>();
        for (int i = 0; i < args.length; i++) {
            String value = i + 1 < args.length ? args[i + 1] : null;
            switch (args[i]) {
                case "--dir" -> dir = value;
                case "--datanodes" -> datanodes = Integer.parseInt(value);
                case "--replication" -> replication = Integer.parseInt(value);
                case "--rpc-port" -> rpcPort = Integer.parseInt(value);
                case "--http-port" -> httpPort = Integer.parseInt(value);
                case "--webhdfs" -> webhdfs = Boolean.parseBoolean(value);
                case "--conf" -> settings.add(value);
                default -> throw new IllegalArgumentException("unknown argument " + args[i]);
            }
            i++;
        }
        if (dir == null) {
            throw new IllegalArgumentException("--dir DIR is required");
        }
        Configuration conf = new Configuration();
        conf.setInt(DFSConfigKeys.DFS_REPLICATION_KEY, replication);
        // a restarted NameNode leaves safe mode as soon as the blocks are reported
        conf.setInt(DFSConfigKeys.DFS_NAMENODE_SAFEMODE_EXTENSION_KEY, 0);
        conf.setBoolean(DFSConfigKeys.DFS_PERMISSIONS_ENABLED_KEY, true);
        // WebHDFS costs seconds of start-up (Jersey scans the shaded jar): only when asked for
        conf.setBoolean("dfs.webhdfs.enabled", webhdfs);
        // DataNodes report quickly after a NameNode restart
        conf.setLong(DFSConfigKeys.DFS_HEARTBEAT_INTERVAL_KEY, 1);
        for (String setting : settings) {
            int eq = setting.indexOf('=');
            if (eq < 1) {
                throw new IllegalArgumentException("--conf KEY=VALUE, got " + setting);
            }
            conf.set(setting.substring(0, eq), setting.substring(eq + 1));
        }
        MiniDFSCluster cluster = new MiniDFSCluster.Builder(conf, new File(dir))
                .numDataNodes(datanodes)
                .nameNodePort(rpcPort)
                .nameNodeHttpPort(httpPort)
                .format(true)
                .build();
        cluster.waitActive();
        MiniDfs dfs = new MiniDfs(cluster);
        System.out.println(dfs.ready());
        System.out.flush();
        try {
            dfs.serve(new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8)));
        } finally {
            cluster.shutdown(true);
        }
        System.exit(0);
    }

    private String stopDataNode(int index) {
        MiniDFSCluster.DataNodeProperties props = cluster.stopDataNode(index);
        if (props == null) {
            return "error no DataNode " + index;
        }
        stopped.add(props);
        return "ok " + index;
    }

    private String ready() {
        return "ready rpc=" + cluster.getNameNodePort()
                + " http=" + cluster.getNameNode().getHttpAddress().getPort();
    }

    private void serve(BufferedReader in) throws Exception {
        String line;
        while ((line = in.readLine()) != null) {
            String[] words = line.trim().split("\\s+");
            if (words[0].isEmpty()) {
                continue;
            }
            if (words[0].equals("quit")) {
                return;
            }
            String answer;
            try {
                answer = run(words);
            } catch (Exception e) {
                answer = "error " + e.getClass().getSimpleName() + ": "
                        + String.valueOf(e.getMessage()).replace('\n', ' ');
            }
            System.out.println(answer);
            System.out.flush();
        }
    }

    private String run(String[] words) throws Exception {
        switch (words[0]) {
            case "ports":
                return "ok " + ready();
            case "stop-namenode":
                cluster.shutdownNameNode(0);
                return "ok";
            case "start-namenode":
                cluster.restartNameNode(0, true);
                return "ok " + ready();
            case "restart-namenode":
                cluster.restartNameNode(0, true);
                return "ok " + ready();
            case "stop-datanode":
                return stopDataNode(Integer.parseInt(words[1]));
            case "stop-datanode-of": {
                BlockLocation[] blocks = cluster.getFileSystem().getFileBlockLocations(
                        new Path(words[1]), 0, 1);
                if (blocks.length == 0) {
                    return "error " + words[1] + " has no block";
                }
                String holder = blocks[0].getNames()[0];
                List<DataNode> running = cluster.getDataNodes();
                for (int i = 0; i < running.size(); i++) {
                    if (running.get(i).getXferAddress().toString().endsWith(
                            ":" + holder.substring(holder.lastIndexOf(':') + 1))) {
                        return stopDataNode(i);
                    }
                }
                return "error no running DataNode holds " + holder;
            }
            case "start-datanodes": {
                for (MiniDFSCluster.DataNodeProperties props : stopped) {
                    // keepPort: the NameNode knows the DataNode by its address
                    cluster.restartDataNode(props, true);
                }
                stopped.clear();
                cluster.waitActive();
                return "ok";
            }
            case "safemode": {
                HdfsConstants.SafeModeAction action = switch (words[1]) {
                    case "enter" -> HdfsConstants.SafeModeAction.SAFEMODE_ENTER;
                    case "leave" -> HdfsConstants.SafeModeAction.SAFEMODE_LEAVE;
                    default -> throw new IllegalArgumentException("safemode enter|leave");
                };
                cluster.getNameNodeRpc().setSafeMode(action, false);
                return "ok";
            }
            default:
                return "error unknown command " + words[0];
        }
    }
}
