//! Compile errors of `#[idempotent]`: one case per file under `ui/`, each with the exact
//! message it must print. Regenerate with `TRYBUILD=overwrite` and read the diff.

#[test]
fn ui() {
    trybuild::TestCases::new().compile_fail("ui/*.rs");
}

/// No expected message sends a user to the library's `__private` module: the items the
/// expansion's bounds name are defined under `idem_runtime::expansion`.
#[test]
fn no_message_names_the_private_module() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ui");
    let mut read = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "stderr") {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(
                !text.contains("__private"),
                "{} names `__private`",
                path.display()
            );
            read += 1;
        }
    }
    assert!(
        read >= 30,
        "only {read} expected messages under {}",
        dir.display()
    );
}
