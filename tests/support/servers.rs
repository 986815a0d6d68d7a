//! Servers of a test's own, started on free ports and stopped by PID when dropped: a Redis
//! server, a Redis Cluster, a PostgreSQL server (in a host of the test's own, too).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::{free_port, unavailable};

/// A `redis-server` of the test's own on a free loopback port, stopped when dropped: for
/// tests that read its counters or kill it.
pub struct PrivateRedis {
    child: std::process::Child,
    /// Its URL.
    pub url: String,
    /// Its port.
    pub port: u16,
}

impl PrivateRedis {
    /// Starts one, or `None` (skipped) when `redis-server` cannot run here.
    pub fn start() -> Option<Self> {
        Self::start_on_a_free_port(Some, |_| Vec::new())
    }

    /// Starts one on a free port with extra `redis-server` arguments (`--replicaof …`).
    pub fn start_with_args(extra: &[String]) -> Option<Self> {
        Self::start_on_a_free_port(Some, |_| extra.to_vec())
    }

    /// Starts one on `port` with extra `redis-server` arguments: a killed server back on
    /// its port in another role.
    pub fn start_on_with_args(port: u16, extra: &[String]) -> Option<Self> {
        match Self::start_with(port, extra.to_vec()) {
            Ok(server) => server,
            Err(Taken) => unavailable("a private redis-server", format!("port {port} is taken")),
        }
    }

    /// Starts one on `port` (a server that comes back after [`kill`](Self::kill)).
    pub fn start_on(port: u16) -> Option<Self> {
        match Self::start_with(port, Vec::new()) {
            Ok(server) => server,
            Err(Taken) => unavailable("a private redis-server", format!("port {port} is taken")),
        }
    }

    /// Starts one on a free port that `accept` agrees to, with the extra arguments `extra`
    /// makes for it. "Free" is only what the port was a moment ago: a port another test took
    /// meanwhile is tried again with another.
    fn start_on_a_free_port(
        accept: impl Fn(u16) -> Option<u16>,
        extra: impl Fn(u16) -> Vec<String>,
    ) -> Option<Self> {
        for _ in 0..50 {
            let Some(port) = free_port().and_then(&accept) else {
                continue;
            };
            match Self::start_with(port, extra(port)) {
                Ok(server) => return server,
                Err(Taken) => continue,
            }
        }
        unavailable("a private redis-server", "no free port in 50 tries")
    }

    /// Starts one on `port` with extra `redis-server` arguments: `Err(Taken)` when another
    /// process serves that port, which a connection alone cannot tell from this one.
    fn start_with(port: u16, extra: Vec<String>) -> Result<Option<Self>, Taken> {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => return Ok(unavailable("redis-server (to start a private server)", e)),
        };
        let pid = child.id();
        let mut server = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            port,
        };
        for _ in 0..250 {
            if let Ok(Some(_)) = server.child.try_wait() {
                return Err(Taken); // it could not bind: another process has the port
            }
            match serving_pid(port) {
                Some(serving) if serving == pid => return Ok(Some(server)),
                Some(_) => {
                    server.kill();
                    return Err(Taken);
                }
                None => {}
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(unavailable(
            "a private redis-server",
            "it did not start listening within 5 s",
        ))
    }

    /// Its process id (to pause it: `kill -STOP`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the server at once.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port another process serves.
struct Taken;

/// The process id of the Redis server on `port`, from its `INFO server`, if one answers.
fn serving_pid(port: u16) -> Option<u32> {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    socket.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    socket.write_all(b"INFO server\r\n").ok()?;
    let mut reply = Vec::new();
    let mut buf = [0; 4096];
    loop {
        let n = socket.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some(rest) = text.split("process_id:").nth(1) {
            if let Some(line) = rest.split("\r\n").next().filter(|_| rest.contains("\r\n")) {
                return line.trim().parse().ok();
            }
        }
    }
}

/// A 3-master Redis Cluster of the test's own, on free loopback ports, stopped and deleted
/// when dropped: `cargo test` needs no cluster started by hand.
pub struct PrivateRedisCluster {
    nodes: Vec<PrivateRedis>,
    dir: std::path::PathBuf,
}

impl PrivateRedisCluster {
    /// Starts the masters, joins them with `redis-cli --cluster create`, and waits until the
    /// cluster answers `cluster_state:ok`; or `None` (skipped) when that cannot be done here.
    pub fn start() -> Option<Self> {
        static CLUSTERS: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem-redis-cluster-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).ok()?;
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        let dir = cluster.dir.to_str()?.to_string();
        for _ in 0..3 {
            // A node also listens on its port + 10000, the cluster bus: both must be free.
            let bus_free = |port: u16| {
                (port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok())
                    .then_some(port)
            };
            let node = PrivateRedis::start_on_a_free_port(bus_free, |port| {
                let config = format!("{dir}/nodes-{port}.conf");
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &config,
                    "--cluster-node-timeout",
                    "2000",
                    "--dir",
                    &dir,
                ]
                .map(str::to_string)
                .to_vec()
            })?;
            cluster.nodes.push(node);
        }
        let mut create = std::process::Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        match create.output() {
            Ok(out) if out.status.success() => {}
            other => return unavailable("redis-cli --cluster create", format!("{other:?}")),
        }
        // Joining is asynchronous: wait (bounded) until every slot is served.
        for _ in 0..500 {
            let info = std::process::Command::new("redis-cli")
                .args(["-p", &cluster.nodes[0].port.to_string(), "cluster", "info"])
                .output()
                .ok()?;
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                return Some(cluster);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        unavailable(
            "a private redis cluster",
            "it did not reach cluster_state:ok within 10 s",
        )
    }

    /// The URLs of its masters.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|node| node.url.clone()).collect()
    }
}

impl Drop for PrivateRedisCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A PostgreSQL server of the test's own (initdb in a temporary folder, a free loopback port,
/// `pg_stat_statements` preloaded), stopped and deleted when dropped: for tests that count
/// its statements or restart it.
pub struct PrivatePostgres {
    bin: std::path::PathBuf,
    dir: std::path::PathBuf,
    port: u16,
    /// Server settings beyond the defaults, as `-c name=value` options.
    settings: Vec<String>,
    /// The command its programs run under: nothing, or `ip netns exec <host>`.
    within: Vec<String>,
    /// The addresses it listens on.
    listen: &'static str,
    /// Its URL.
    pub url: String,
}

impl PrivatePostgres {
    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts one, or `None` (skipped) when PostgreSQL's server programs are not here.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// Starts one with server `settings` (`("synchronous_standby_names", "standby")`).
    pub fn start_with(settings: &[(&str, &str)]) -> Option<Self> {
        Self::initialised(Self::prepared()?, settings)
    }

    /// Starts one in a host of the test's own (`within`: [`crate::netns::Network::within`]),
    /// listening on every address there; its `url` is the loopback one, which only that
    /// host reaches.
    pub fn start_within(within: Vec<String>) -> Option<Self> {
        let mut server = Self::prepared()?;
        server.within = within;
        server.listen = "*";
        Self::initialised(server, &[])
    }

    fn initialised(mut server: Self, settings: &[(&str, &str)]) -> Option<Self> {
        server.settings = settings
            .iter()
            .map(|(k, v)| format!("-c {k}={v}"))
            .collect();
        let data = server.dir.join("data");
        let initdb = server.bin.join("initdb");
        if let Err(e) = server.postgres(
            &initdb,
            &[
                "-D",
                data.to_str()?,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        ) {
            return unavailable("initdb (to start a private postgresql)", e);
        }
        if server.listen != "127.0.0.1" {
            // Clients from other hosts, trusted as on loopback.
            let hba = data.join("pg_hba.conf");
            let rules = std::fs::read_to_string(&hba).ok()?;
            std::fs::write(&hba, rules + "host all all 0.0.0.0/0 trust\n").ok()?;
        }
        if let Err(e) = server.ctl("start") {
            return unavailable("a private postgresql", e);
        }
        Some(server)
    }

    /// A streaming standby of `primary`, copied with `pg_basebackup` and started on a port of
    /// its own; it connects as `application_name=standby`.
    pub fn standby_of(primary: &Self) -> Option<Self> {
        let server = Self::prepared()?;
        let data = server.dir.join("data");
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name=standby",
            primary.port
        );
        let basebackup = server.bin.join("pg_basebackup");
        if let Err(e) = server.postgres(
            &basebackup,
            &[
                "-d",
                &conninfo,
                "-D",
                data.to_str()?,
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        ) {
            return unavailable("pg_basebackup (to start a standby)", e);
        }
        if let Err(e) = server.ctl("start") {
            return unavailable("a private standby", e);
        }
        Some(server)
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`): no shutdown
    /// checkpoint, and no more WAL for its standbys.
    pub fn crash(&self) {
        let data = self.dir.join("data").display().to_string();
        let ctl = self.bin.join("pg_ctl");
        self.postgres(&ctl, &["-D", &data, "-m", "immediate", "-w", "stop"])
            .expect("stop the private postgresql");
    }

    /// Starts the server again after a [`crash`](Self::crash), on its port and data.
    pub fn start_again(&self) {
        self.ctl("start")
            .expect("start the private postgresql again");
    }

    /// Promotes a standby to a primary, and waits until it is one.
    pub fn promote(&self) {
        let data = self.dir.join("data").display().to_string();
        let ctl = self.bin.join("pg_ctl");
        self.postgres(&ctl, &["-D", &data, "-w", "promote"])
            .expect("promote the private standby");
    }

    /// A server's directory and port, before anything runs there.
    fn prepared() -> Option<Self> {
        let bin = match std::process::Command::new("pg_config")
            .arg("--bindir")
            .output()
        {
            Ok(out) if out.status.success() => {
                std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
            other => {
                return unavailable(
                    "pg_config (to start a private postgresql)",
                    format!("{other:?}"),
                )
            }
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let dir = std::env::temp_dir().join(format!("idem-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let server = Self {
            bin,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
            port,
            settings: Vec::new(),
            within: Vec::new(),
            listen: "127.0.0.1",
        };
        if as_root() {
            run("chown", &["postgres:postgres", server.dir.to_str()?]).ok()?;
        }
        Some(server)
    }

    /// The server's log so far (with `log_statement = 'all'` set in a session, every
    /// statement that session runs, as the server received it).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// Restarts the server (a fast shutdown, then a start): what a deploy or a crash does.
    pub fn restart(&self) {
        self.ctl("restart").expect("restart the private postgresql");
    }

    fn ctl(&self, action: &str) -> Result<(), String> {
        let data = self.dir.join("data");
        let options = format!(
            "-p {} -k {} -c listen_addresses={} -c shared_preload_libraries=pg_stat_statements -c fsync=off {}",
            self.port,
            self.dir.display(),
            self.listen,
            self.settings.join(" ")
        );
        let log = self.dir.join("log");
        let ctl = self.bin.join("pg_ctl");
        self.postgres(
            &ctl,
            &[
                "-D",
                &data.display().to_string(),
                "-l",
                &log.display().to_string(),
                "-o",
                &options,
                "-m",
                "fast",
                "-w",
                action,
            ],
        )
    }

    /// Runs a server program as `postgres` (it refuses to run as root).
    fn postgres(&self, program: &std::path::Path, args: &[&str]) -> Result<(), String> {
        let program = program.display().to_string();
        let mut all: Vec<&str> = self.within.iter().map(String::as_str).collect();
        if as_root() {
            all.extend(["runuser", "-u", "postgres", "--"]);
        }
        all.push(&program);
        all.extend_from_slice(args);
        run(all[0], &all[1..])
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.dir.join("data").display().to_string();
        let ctl = self.bin.join("pg_ctl");
        let _ = self.postgres(&ctl, &["-D", &data, "-m", "immediate", "-w", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs `program` with `args` to its end: `Err` with its stderr if it failed.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
