//! A service of an example in a process of its own, for the examples' tests: started as one
//! ignored test of the test binary itself, its stdout's lines on a channel, SIGKILLed on drop
//! or stopped by closing its stdin ([`Service::finish`], [`stdin_closed`]).
//! Each test uses what it needs of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use tokio::sync::mpsc;

pub struct Service {
    child: Child,
    /// Held open while the service runs: its end asks the service to stop.
    stdin: Option<ChildStdin>,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Service {
    /// Runs the ignored test `test` of this binary, with `env` set.
    pub fn start(test: &str, env: &[(&str, String)]) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--ignored", "--exact", test, "--nocapture"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (send, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// Waits for a line that starts with `what` (bounded: a minute), and returns it.
    pub async fn said(&mut self, what: &str) -> String {
        let wait = async {
            while let Some(line) = self.lines.recv().await {
                if line.starts_with(what) {
                    return line;
                }
            }
            panic!("the service ended before it said {what:?}");
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .unwrap_or_else(|_| panic!("the service never said {what:?}"))
    }
}

impl Service {
    /// The next line the service prints (bounded: a minute); `None` once it ended.
    pub async fn line(&mut self) -> Option<String> {
        tokio::time::timeout(Duration::from_secs(60), self.lines.recv())
            .await
            .expect("the service printed nothing for a minute")
    }
}

impl Service {
    /// Asks the service to stop (its stdin closes) and waits for it to exit (bounded: a
    /// minute), for services that must settle what they hold before they go.
    pub async fn finish(mut self) {
        drop(self.stdin.take());
        let exited = tokio::time::timeout(Duration::from_secs(60), async {
            // Its stdout ends when it exits.
            while self.lines.recv().await.is_some() {}
        });
        exited
            .await
            .expect("the service did not stop within a minute");
    }
}

/// Resolves when this process's stdin closes: how a service started by [`Service::start`]
/// is asked to stop.
pub async fn stdin_closed() {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0_u8; 64];
    while matches!(stdin.read(&mut buffer).await, Ok(n) if n > 0) {}
}

impl Service {
    /// SIGKILL, and the process reaped.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGKILLs the service and returns the lines it printed that were not read yet.
    pub async fn kill_and_drain(&mut self) -> Vec<String> {
        self.kill();
        let mut left = Vec::new();
        // Its stdout ends with it: the reader sends what was in the pipe, then stops.
        while let Some(line) = self.lines.recv().await {
            left.push(line);
        }
        left
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port.
pub fn free_addr() -> std::net::SocketAddr {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}
