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
    /// Its URL (user `root`, no password, database `test`).
    pub url: String,
}

impl PrivateMariaDb {
    /// Starts one, or `None` (skipped; failed with `IDEM_REQUIRE_SERVICES=1`) when MariaDB's
    /// server programs are not here.
    pub fn start() -> Option<Self> {
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
        let child = match Self::spawn(&dir, port) {
            Ok(child) => child,
            Err(e) => return unavailable("mariadbd (to start a private server)", e),
        };
        let mut server = Self {
            child,
            url: format!("mysql://root@127.0.0.1:{port}/test"),
            dir,
            port,
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
        self.child = Self::spawn(&self.dir, self.port).expect("start mariadbd again");
        self.wait_until_serving().expect("mariadbd serves again");
    }

    fn spawn(dir: &std::path::Path, port: u16) -> std::io::Result<std::process::Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("log"))?;
        Command::new("mariadbd")
            .args([
                "--no-defaults".to_string(),
                format!("--datadir={}", dir.join("data").display()),
                format!("--port={port}"),
                "--bind-address=127.0.0.1".to_string(),
                format!("--socket={}", dir.join("sock").display()),
                format!("--pid-file={}", dir.join("pid").display()),
                format!("--user={}", user()),
                "--skip-log-bin".to_string(),
                "--skip-name-resolve".to_string(),
                "--innodb-buffer-pool-size=16M".to_string(),
            ])
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
