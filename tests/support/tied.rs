//! Servers that live exactly as long as the test process that started them.

use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;

/// Runs `command` (a program and its arguments) in the background for as long as this
/// process lives: a shell holds it and the read end of a pipe whose write end only this
/// process holds, so that when the process ends, however it ends (a SIGKILL too), the shell
/// reads the end of the pipe and stops the server. No test leaves one running. `None` when
/// the shell cannot be started.
pub fn spawn(command: &[&str]) -> Option<()> {
    static KEPT: Mutex<Vec<(Child, ChildStdin)>> = Mutex::new(Vec::new());
    let script = r#""$@" </dev/null >/dev/null 2>&1 &
server=$!
read -r _
kill "$server""#;
    let mut shell = Command::new("sh")
        .args(["-c", script, "sh"])
        .args(command)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let pipe = shell.stdin.take()?;
    // Never dropped: the pipe closes when the process does.
    KEPT.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push((shell, pipe));
    Some(())
}
