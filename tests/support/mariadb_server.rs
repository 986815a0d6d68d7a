//! A MariaDB (or MySQL) server of the test's own: `mariadb-install-db` into a temporary
//! folder, `mariadbd` on a free loopback port, killed by PID and started again on the same
//! files, deleted when dropped. For tests that crash and restart the server, which the
//! shared one must never be.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, unavailable};

/// A private `mariadbd`, stopped and deleted when dropped.
pub struct PrivateMariaDb {
    child: std::process::Child,
    dir: PathBuf,
    port: u16,
    /// Server options beyond the defaults (replication, semi-synchronous commits).
    options: Vec<String>,
    /// Its URL (user `root`, no password, database `test`).
    pub url: String,
}

impl PrivateMariaDb {
    /// Starts one, or `None` (skipped; failed with `IDEM_REQUIRE_SERVICES=1`) when MariaDB's
    /// server programs are not here.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// A primary for [`replica_of`](Self::replica_of): binary log on, `server_id` 1.
    pub fn primary() -> Option<Self> {
        Self::start_with(&["--server-id=1", "--log-bin=binlog", "--binlog-format=ROW"])
    }

    /// A replica of `primary` (`server_id` 2, with `options`), replicating from the
    /// primary's position now (after its own set-up), and applying: its tables are the
    /// primary's from here on.
    pub fn replica_of(primary: &Self, options: &[&str]) -> Option<Self> {
        let mut all = vec!["--server-id=2", "--log-bin=binlog", "--binlog-format=ROW"];
        all.extend_from_slice(options);
        let replica = Self::start_with(&all)?;
        let position = primary.query("SELECT @@GLOBAL.gtid_binlog_pos")?;
        replica.sql(&format!(
            "RESET MASTER; SET GLOBAL gtid_slave_pos = '{position}'; \
             CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {}, MASTER_USER = 'root', \
             MASTER_CONNECT_RETRY = 1, MASTER_USE_GTID = slave_pos; START SLAVE",
            primary.port
        ))?;
        Some(replica)
    }

    /// Runs `statements` as root, or says why not.
    pub fn sql(&self, statements: &str) -> Option<()> {
        self.query(statements).map(drop)
    }

    /// The output of `statements` as root (tab-separated, no column names), or `None`.
    pub fn query(&self, statements: &str) -> Option<String> {
        let out = Command::new("mariadb")
            .args([
                "-uroot",
                "-h127.0.0.1",
                &format!("-P{}", self.port),
                "-N",
                "-B",
                "-e",
                statements,
            ])
            .output()
            .ok()?;
        if !out.status.success() {
            return unavailable(
                "a private mariadbd",
                format!("{statements}: {}", String::from_utf8_lossy(&out.stderr)),
            );
        }
        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    fn start_with(options: &[&str]) -> Option<Self> {
        let options: Vec<String> = options.iter().map(|option| option.to_string()).collect();
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("idem-mariadb-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).ok()?;
        let installed = Command::new("mariadb-install-db")
            .args([
                "--no-defaults",
                &format!("--datadir={}", dir.join("data").display()),
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                &format!("--user={}", user()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        match installed {
            Ok(status) if status.success() => {}
            other => {
                return unavailable(
                    "mariadb-install-db (to start a private server)",
                    format!("{other:?}"),
                )
            }
        }
        let child = match Self::spawn(&dir, port, &options) {
            Ok(child) => child,
            Err(e) => return unavailable("mariadbd (to start a private server)", e),
        };
        let mut server = Self {
            child,
            url: format!("mysql://root@127.0.0.1:{port}/test"),
            dir,
            port,
            options,
        };
        server.wait_until_serving()?;
        let created = Command::new("mariadb")
            .args([
                "-uroot",
                "-h127.0.0.1",
                &format!("-P{port}"),
                "-e",
                "CREATE DATABASE test",
            ])
            .status();
        if !created.is_ok_and(|status| status.success()) {
            return unavailable("a private mariadbd", "CREATE DATABASE test failed");
        }
        Some(server)
    }

    /// Kills the server with SIGKILL, as a crash or a lost machine would: nothing is flushed
    /// beyond what InnoDB made durable at each commit.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on its files and port (after [`kill`](Self::kill)), and
    /// waits until it serves: InnoDB's crash recovery runs first.
    pub fn start_again(&mut self) {
        self.child =
            Self::spawn(&self.dir, self.port, &self.options).expect("start mariadbd again");
        self.wait_until_serving().expect("mariadbd serves again");
    }

    fn spawn(
        dir: &std::path::Path,
        port: u16,
        options: &[String],
    ) -> std::io::Result<std::process::Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("log"))?;
        let logs = options.iter().any(|option| option.starts_with("--log-bin"));
        Command::new("mariadbd")
            .args([
                "--no-defaults".to_string(),
                format!("--datadir={}", dir.join("data").display()),
                format!("--port={port}"),
                "--bind-address=127.0.0.1".to_string(),
                format!("--socket={}", dir.join("sock").display()),
                format!("--pid-file={}", dir.join("pid").display()),
                format!("--user={}", user()),
                "--skip-name-resolve".to_string(),
                "--innodb-buffer-pool-size=16M".to_string(),
            ])
            .args((!logs).then(|| "--skip-log-bin".to_string()))
            .args(options)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
    }

    /// Waits until the server accepts connections (it listens once it is ready), or says
    /// why not.
    fn wait_until_serving(&mut self) -> Option<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
                return unavailable("a private mariadbd", format!("it exited ({status}): {log}"));
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Some(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        unavailable("a private mariadbd", "it did not listen within 60 s")
    }
}

impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The user the server runs as: `root` when the test is root (which `mariadbd` accepts only
/// when told), else whoever runs the test.
fn user() -> String {
    Command::new("id")
        .arg("-un")
        .output()
        .ok()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "root".to_string())
}
