//! One side of a bench in a process of its own under `valgrind --tool=callgrind`, counting
//! only inside the function `measured` matches (and what it calls).

use std::process::Command;

/// Runs this bench again with `args` (and `env`) under callgrind, counting in `measured`
/// (a `--toggle-collect` pattern): the instructions counted, and what the run printed.
pub fn collected(measured: &str, args: &[&str], env: &[(&str, &str)]) -> (u64, String) {
    let out = Command::new("valgrind")
        .args([
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            &format!("--toggle-collect={measured}"),
        ])
        .arg(std::env::current_exe().unwrap())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|err| panic!("valgrind could not run ({err}): is it installed?"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed:\n{stderr}");
    let total = stderr
        .lines()
        .find_map(|line| line.split_once("Collected :")?.1.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count from callgrind:\n{stderr}"));
    (total, String::from_utf8_lossy(&out.stdout).into_owned())
}
