//! A child process of the test binary, run as one of its ignored tests.

use std::time::Duration;

/// A child process of this test binary, running one of its ignored tests (a holder to kill,
/// a server to restart): its stdout read line by line, and SIGKILLed and reaped on drop, so
/// that no test leaves one behind.
pub struct Child {
    process: std::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Child {
    /// Starts the ignored test `test` of this binary, with `env` set.
    pub fn start(test: &str, env: &[(&str, &str)]) -> Self {
        Self::start_as(
            std::process::Command::new(std::env::current_exe().unwrap()),
            test,
            env,
        )
    }

    /// Starts the ignored test `test` of this binary through `command`, a command that runs
    /// this binary (in a host of its own: [`crate::netns::Network::command`]), with `env` set.
    pub fn start_as(mut command: std::process::Command, test: &str, env: &[(&str, &str)]) -> Self {
        use std::io::{BufRead, BufReader};

        command
            .args(["--ignored", "--exact", test, "--nocapture"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        if let Some(url) = crate::dynamodb_server::started_dynamodb_url() {
            command.env("IDEM_DYNAMODB_URL", url);
        }
        for (name, value) in env {
            command.env(name, value);
        }
        let mut process = command.spawn().unwrap();
        let stdout = process.stdout.take().unwrap();
        let (send, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Self { process, lines }
    }

    /// Writes `line` to the child's standard input (its instructions).
    pub fn say(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.process.stdin.as_mut().expect("the child's stdin");
        writeln!(stdin, "{line}").expect("the child reads its stdin");
    }

    /// Waits until the child prints a line containing `what` (its signal, never a sleep).
    /// Panics if it exits first, or says nothing for a minute.
    pub async fn wait_for(&mut self, what: &str) {
        self.line_with(what).await;
    }

    /// Waits until the child prints a line containing `what`, and returns that line. Panics
    /// if it exits first, or says nothing for a minute.
    pub async fn line_with(&mut self, what: &str) -> String {
        loop {
            let line = self.next_line().await;
            if line.contains(what) {
                return line;
            }
        }
    }

    /// The next line the child prints. Panics if it exits first, or says nothing for a
    /// minute.
    pub async fn next_line(&mut self) -> String {
        let line = tokio::time::timeout(Duration::from_secs(60), self.lines.recv()).await;
        line.expect("the child stalled").expect("the child exited")
    }

    /// SIGKILL: no destructor runs, nothing is released. Returns how many of the lines it
    /// printed that the test has not read contain `what`: every one of them, read to the end
    /// of its output (a line still in the pipe when the child died is counted too, however
    /// late the thread that reads the pipe runs). Panics if its output has not ended a
    /// minute after its death.
    pub fn kill(&mut self, what: &str) -> usize {
        self.kill_reading()
            .iter()
            .filter(|line| line.contains(what))
            .count()
    }

    /// SIGKILL, as [`kill`](Self::kill): every line it printed that the test has not read,
    /// to the end of its output.
    pub fn kill_reading(&mut self) -> Vec<String> {
        let _ = self.process.kill();
        let _ = self.process.wait();
        self.rest()
    }

    /// Every line the child printed that the test has not read, to the end of its output:
    /// for a child that exited or was killed. Panics if its output has not ended a minute
    /// after.
    pub fn rest(&mut self) -> Vec<String> {
        use tokio::sync::mpsc::error::TryRecvError;

        let stalled = std::time::Instant::now() + Duration::from_secs(60);
        let mut lines = Vec::new();
        loop {
            match self.lines.try_recv() {
                Ok(line) => lines.push(line),
                // The reader saw the end of the pipe: every line is in.
                Err(TryRecvError::Disconnected) => return lines,
                Err(TryRecvError::Empty) => {
                    assert!(
                        std::time::Instant::now() < stalled,
                        "the dead child's output did not end"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
