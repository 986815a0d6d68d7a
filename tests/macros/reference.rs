//! The README's table of `#[idempotent]` arguments is the attribute's rustdoc, word for word:
//! both are `idem-macros/src/reference.md`, whose examples the macro's unit tests parse.

#[test]
fn the_readme_s_argument_table_is_the_attribute_s() {
    let readme = include_str!("../../README.md");
    let reference = include_str!("../../idem-macros/src/reference.md");
    let start = "<!-- reference:start -->\n";
    let end = "<!-- reference:end -->";
    let from = readme
        .find(start)
        .expect("README.md marks the reference's start")
        + start.len();
    let to = readme[from..]
        .find(end)
        .expect("README.md marks the reference's end")
        + from;
    assert_eq!(
        &readme[from..to],
        reference,
        "README.md's argument table differs from idem-macros/src/reference.md: copy the file between the markers"
    );
}

/// The README's table of features names every feature of `idem-runtime/Cargo.toml`, once,
/// marks the default ones, and names every crate each one pulls in.
#[test]
fn the_readme_s_feature_table_is_the_manifest_s() {
    let readme = include_str!("../../README.md");
    let manifest = include_str!("../../idem-runtime/Cargo.toml");
    let table = between(readme, "<!-- features:start -->\n", "<!-- features:end -->");
    let mut rows = std::collections::BTreeMap::new();
    for row in table.lines().skip(2) {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        assert_eq!(cells.len(), 3, "a row of three cells: {row}");
        let (name, default) = match cells[0].strip_suffix(" (default)") {
            Some(name) => (name, true),
            None => (cells[0], false),
        };
        let name = name.trim_matches('`').to_string();
        assert!(
            rows.insert(name.clone(), (default, cells[2].to_string()))
                .is_none(),
            "`{name}` twice in README.md's feature table"
        );
    }

    let features = between(manifest, "[features]\n", "\n[");
    let mut declared = std::collections::BTreeMap::new();
    for line in features.lines().filter(|line| !line.starts_with('#')) {
        let Some((name, enables)) = line.split_once(" = ") else {
            continue;
        };
        let enables: Vec<String> = enables
            .trim_matches(|c| c == '[' || c == ']')
            .split(", ")
            .filter(|item| !item.is_empty())
            .map(|item| item.trim_matches('"').to_string())
            .collect();
        declared.insert(name.to_string(), enables);
    }
    let defaults = declared.remove("default").expect("a default feature set");

    assert_eq!(
        rows.keys().collect::<Vec<_>>(),
        declared.keys().collect::<Vec<_>>(),
        "README.md's feature table and idem-runtime's [features] name different features"
    );
    for (name, enables) in &declared {
        let (default, pulls_in) = &rows[name];
        assert_eq!(
            *default,
            defaults.contains(name),
            "`{name}`: README.md's table and Cargo.toml disagree on whether it is a default"
        );
        for item in enables {
            // `dep:redis` is the crate `redis`; `http` another feature; `sqlx/postgres` a
            // feature of a crate already named.
            let named = item.strip_prefix("dep:").unwrap_or(item);
            let named = named.split('/').next().unwrap();
            assert!(
                pulls_in.contains(&format!("`{named}`")),
                "`{name}` enables `{item}`, which README.md's table does not name: {pulls_in}"
            );
        }
    }
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text.find(start).unwrap_or_else(|| panic!("no {start:?}")) + start.len();
    let to = text[from..]
        .find(end)
        .unwrap_or_else(|| panic!("no {end:?}"))
        + from;
    &text[from..to]
}
