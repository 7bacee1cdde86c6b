//! The modules are layered (see the crate docs in src/lib.rs): every
//! `crate::` path in a module names the module itself or one below it. This
//! reads src/ and fails on a path that runs back up, or on a module that is
//! not in the order below.

use std::fs;
use std::path::{Path, PathBuf};

/// The modules, lowest first. A module may use those before it.
const ORDER: &[&str] = &[
    // arithmetic, errors, msgpack, the host engine's thread pool
    "error",
    "checksum",
    "stored_entry",
    "msgpack",
    "topology",
    "pool",
    // inputs: layer decodings, token placements, state layers, layouts, block sets, fingerprints, the caller's stream
    "decoding",
    "placement",
    "state",
    "layout",
    "layout_string",
    "blocks",
    "fingerprint",
    "stream",
    // results: the worker facts a record carries, a call's checksums
    "record_facts",
    "result",
    // the plan of a call
    "plan",
    // engines
    "host",
    "cuda",
    "detail",
    "stored",
    // the worker
    "worker",
    // the values of a worker's full blocks by block hash
    "tier_index",
    // records and payloads
    "record",
    "payload",
    // the verifier
    "verify",
    // the repair plan of a verifier's report
    "repair",
    // the C boundary
    "ffi",
];

/// The top-level module a file under src/ belongs to (`None` for lib.rs).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).unwrap();
    let first = relative.components().next().unwrap().as_os_str().to_str().unwrap();
    match first.strip_suffix(".rs") {
        Some("lib") => None,
        Some(name) => Some(name.to_owned()),
        None => Some(first.to_owned()),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a line names through `crate::` or `$crate::`
/// (`crate::{a, b::c}` included); comments are skipped.
fn referenced(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap();
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `kvcrate::`, not a crate path
        }
        if let Some(inner) = rest.strip_prefix('{') {
            // Top-level names inside the braces (nested braces skipped).
            let mut depth = 0;
            let mut word = String::new();
            let mut at_start = true;
            for c in inner.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => at_start = true,
                    c if depth == 0 && at_start && (c.is_alphanumeric() || c == '_') => word.push(c),
                    c if depth == 0 && at_start && !c.is_whitespace() => {
                        if !word.is_empty() {
                            names.push(std::mem::take(&mut word));
                        }
                        at_start = false;
                    }
                    _ => {}
                }
            }
            if !word.is_empty() {
                names.push(word);
            }
        } else {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            names.push(name);
        }
    }
    names
}

#[test]
fn imports_run_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let rank = |name: &str| ORDER.iter().position(|m| *m == name);
    let mut problems = Vec::new();
    let mut modules_seen = 0;
    for file in &files {
        let Some(module) = module_of(&src, file) else { continue };
        modules_seen += 1;
        let Some(own) = rank(&module) else {
            problems.push(format!(
                "{}: module `{module}` is not in tests/it/module_imports.rs's ORDER; add it at its layer",
                file.display()
            ));
            continue;
        };
        let text = fs::read_to_string(file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for name in referenced(line) {
                // Crate-root re-exports (`crate::Result`) name no module.
                let Some(target) = rank(&name) else {
                    if name.chars().next().is_some_and(|c| c.is_lowercase()) {
                        problems.push(format!(
                            "{}:{}: `crate::{name}` is not a module in ORDER",
                            file.display(),
                            number + 1
                        ));
                    }
                    continue;
                };
                if target > own {
                    problems.push(format!(
                        "{}:{}: `{module}` uses `{name}`, which is above it in the layering: {}",
                        file.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        modules_seen > 20,
        "read only {modules_seen} files under {}",
        src.display()
    );
    assert!(
        problems.is_empty(),
        "imports that run up the layers:\n{}",
        problems.join("\n")
    );
}

/// Crate-root paths (`crate::Result`) are re-exports of lower modules, but
/// hide which one; the engine names the module instead.
#[test]
fn no_module_uses_root_reexports_of_higher_layers() {
    // `crate::Result` is the only root path in use, and `error` is the bottom layer.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for name in referenced(line) {
                let upper = name.chars().next().is_some_and(|c| c.is_uppercase());
                assert!(
                    !upper || name == "Result" || name == "Error",
                    "{}:{}: `crate::{name}` hides which module it comes from; name the module",
                    file.display(),
                    number + 1
                );
            }
        }
    }
}

#[test]
fn the_scanner_finds_paths() {
    assert_eq!(referenced("use crate::layout::{Layout, Role};"), ["layout"]);
    assert_eq!(
        referenced("use crate::{blocks::BlockSet, plan::{Plan, Row}};"),
        ["blocks", "plan"]
    );
    assert_eq!(
        referenced("    $crate::ffi::status::fail(&$crate::error::Error::X)"),
        ["ffi", "error"]
    );
    assert_eq!(referenced("// use crate::worker::Worker;"), Vec::<String>::new());
    assert_eq!(referenced("let x = crate::record::Record::decode(b)?;"), ["record"]);
}

/// Where a path starts: the crate root, or the module `levels` above the
/// one it is written in (`self::` 0, `super::` 1, `super::super::` 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathRoot {
    Crate,
    Up(usize),
}

/// Every module path a line names through `crate::`, `$crate::`, `self::`,
/// `super::` or the name of one of `children` (the modules the file
/// declares: `mod name;`), as its root and segments (use-trees
/// `a::{b, c::d}` expanded); comments are skipped.
fn module_paths(line: &str, children: &[String]) -> Vec<(PathRoot, Vec<String>)> {
    let code = line.split("//").next().unwrap();
    let mut paths = Vec::new();
    let mut at = 0;
    while at < code.len() {
        let rest = &code[at..];
        let before = code[..at].chars().last();
        let starts_word = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
        // A child's name starts a path of its own, not the tail of another.
        let starts_path = starts_word && !code[..at].ends_with("::");
        let root = [
            ("crate::", PathRoot::Crate),
            ("self::", PathRoot::Up(0)),
            ("super::", PathRoot::Up(1)),
        ]
        .into_iter()
        .find(|(prefix, _)| starts_word && rest.starts_with(prefix))
        .or_else(|| {
            let child = children
                .iter()
                .find(|child| starts_path && rest.strip_prefix(child.as_str()).is_some_and(|r| r.starts_with("::")));
            child.map(|_| ("", PathRoot::Up(0)))
        });
        let Some((prefix, mut root)) = root else {
            at += rest.chars().next().unwrap().len_utf8();
            continue;
        };
        let mut tail = &rest[prefix.len()..];
        while let (PathRoot::Up(n), Some(more)) = (root, tail.strip_prefix("super::")) {
            root = PathRoot::Up(n + 1);
            tail = more;
        }
        let (trees, used) = use_tree(tail);
        paths.extend(trees.into_iter().map(|segments| (root, segments)));
        at += prefix.len() + (rest.len() - prefix.len() - tail.len()) + used.max(1);
    }
    paths
}

/// The paths of the use-tree at the start of `text` (`a::b`, `a::{b, c::d}`,
/// `a::*`) and the bytes it spans.
fn use_tree(text: &str) -> (Vec<Vec<String>>, usize) {
    let word: String = text.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    let mut used = word.len();
    if text[used..].starts_with('{') {
        // A group: each member a tree of its own.
        let mut paths = Vec::new();
        used += 1;
        loop {
            let skipped = text[used..].len() - text[used..].trim_start_matches([' ', ',']).len();
            used += skipped;
            if used >= text.len() || text[used..].starts_with('}') {
                return (paths, used + 1);
            }
            let (members, member_used) = use_tree(&text[used..]);
            paths.extend(members);
            used += member_used.max(1);
        }
    }
    if word.is_empty() {
        return (Vec::new(), used);
    }
    match text[used..].strip_prefix("::") {
        Some(after) if !after.starts_with('*') => {
            let (rest, rest_used) = use_tree(after);
            used += 2 + rest_used;
            if rest.is_empty() {
                return (vec![vec![word]], used);
            }
            let paths = rest
                .into_iter()
                .map(|tail| std::iter::once(word.clone()).chain(tail).collect())
                .collect();
            (paths, used)
        }
        _ => (vec![vec![word]], used),
    }
}

/// The module a file under src/ is (`["cuda", "buffers"]` for
/// src/cuda/buffers.rs, `["cuda"]` for src/cuda/mod.rs, empty for lib.rs).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut path: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_str().unwrap().to_owned())
        .collect();
    if matches!(path.last().map(String::as_str), Some("mod" | "lib")) {
        path.pop();
    }
    path
}

/// The modules each module under src/ uses (files, lib.rs left out), read
/// from every `crate::`, `self::` and `super::` path outside its tests: a
/// path names the deepest module it runs through.
fn module_graph(src: &Path) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: std::collections::BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|file| (module_path(src, file), file.clone()))
        .filter(|(module, _)| !module.is_empty())
        .collect();
    let mut graph = std::collections::BTreeMap::new();
    for (module, file) in &modules {
        let uses: &mut std::collections::BTreeSet<String> = graph.entry(module.join("::")).or_default();
        let text = fs::read_to_string(file).unwrap();
        let children: Vec<String> = text
            .lines()
            .filter_map(|line| {
                let declared = line.trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
                declared.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
            })
            .collect();
        for line in text.lines() {
            if line.trim() == "#[cfg(test)]" {
                break; // Unit tests close their file.
            }
            for (root, segments) in module_paths(line, &children) {
                let base = match root {
                    PathRoot::Crate => &module[..0],
                    PathRoot::Up(levels) => &module[..module.len().saturating_sub(levels)],
                };
                let full: Vec<String> = base.iter().chain(&segments).cloned().collect();
                let target = (1..=full.len())
                    .rev()
                    .map(|n| &full[..n])
                    .find(|m| modules.contains_key(*m));
                if let Some(target) = target.filter(|target| *target != module.as_slice()) {
                    uses.insert(target.join("::"));
                }
            }
        }
    }
    graph
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first, colouring modules in progress; a use of one in progress closes a cycle.
    fn visit<'a>(
        module: &'a str,
        graph: &'a std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        done: &mut std::collections::BTreeSet<&'a str>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|m| *m == module) {
            return Some(stack[at..].iter().chain([&module]).map(|m| m.to_string()).collect());
        }
        if !done.insert(module) {
            return None;
        }
        stack.push(module);
        for used in graph.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(used, graph, done, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        None
    }
    let mut done = std::collections::BTreeSet::new();
    graph
        .keys()
        .find_map(|module| visit(module, graph, &mut done, &mut Vec::new()))
}

/// No module depends on itself through others: every folder's modules
/// (src/cuda/, src/verify/, src/ffi/) included, the folder's mod.rs being
/// a module of its own.
#[test]
fn no_module_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(
        graph.contains_key("cuda::buffers") && graph["cuda"].contains("cuda::buffers"),
        "the scanner reads folder modules: {graph:?}"
    );
    assert_eq!(
        find_cycle(&graph),
        None,
        "modules that import each other, around this cycle"
    );
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let graph = |edges: &[(&str, &str)]| {
        let mut graph = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
        for (from, to) in edges {
            graph.entry(from.to_string()).or_default().insert(to.to_string());
            graph.entry(to.to_string()).or_default();
        }
        graph
    };
    assert_eq!(find_cycle(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(
        find_cycle(&graph(&[("a", "b"), ("b", "c"), ("c", "b")])),
        Some(vec!["b".to_owned(), "c".to_owned(), "b".to_owned()])
    );
    assert_eq!(
        find_cycle(&graph(&[("x::y", "x"), ("x", "x::y")])),
        Some(vec!["x".to_owned(), "x::y".to_owned(), "x".to_owned()])
    );
}

#[test]
fn the_path_scanner_reads_use_trees() {
    let children = ["collect".to_owned()];
    let paths = |line| {
        module_paths(line, &children)
            .into_iter()
            .map(|(root, segments)| (root, segments.join("::")))
            .collect::<Vec<_>>()
    };
    use PathRoot::*;
    assert_eq!(
        paths("use super::buffers::{device_error, Slot};"),
        [
            (Up(1), "buffers::device_error".to_owned()),
            (Up(1), "buffers::Slot".to_owned())
        ]
    );
    assert_eq!(
        paths("use crate::{blocks::BlockSet, plan::{Plan, Row}};"),
        [
            (Crate, "blocks::BlockSet".to_owned()),
            (Crate, "plan::Plan".to_owned()),
            (Crate, "plan::Row".to_owned())
        ]
    );
    assert_eq!(
        paths("use super::super::descriptors::*;"),
        [(Up(2), "descriptors".to_owned())]
    );
    assert_eq!(
        paths("    $crate::ffi::status::fail(x)"),
        [(Crate, "ffi::status::fail".to_owned())]
    );
    assert_eq!(
        paths("use self::launch::plan_launch;"),
        [(Up(0), "launch::plan_launch".to_owned())]
    );
    assert_eq!(paths("let x = Self::new(); // super::a"), []);
    // A declared child names itself; the tail of another path does not.
    assert_eq!(paths("use collect::{Load, Settings};").len(), 2);
    assert_eq!(paths("let x = other::collect::f();"), []);
    // A module path in src/cuda/buffers.rs: super is cuda.
    let src = Path::new("/r/src");
    assert_eq!(
        module_path(src, Path::new("/r/src/cuda/buffers.rs")),
        ["cuda", "buffers"]
    );
    assert_eq!(module_path(src, Path::new("/r/src/cuda/mod.rs")), ["cuda"]);
    assert!(module_path(src, Path::new("/r/src/lib.rs")).is_empty());
}

/// docs/ARCHITECTURE.md's numbered list is the one description of the
/// modules: it names every module of `ORDER`, in that order, so a module
/// added at a layer cannot go undocumented or documented at another.
#[test]
fn the_architecture_page_lists_the_modules_in_layer_order() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md");
    let page = fs::read_to_string(&path).unwrap();
    let modules = page.split("\n## Modules\n").nth(1).expect("a section `## Modules`");
    let modules = modules.split("\n## ").next().unwrap();
    let list = &modules[modules.find("\n1. ").expect("a numbered list of the layers")..];
    let mut last: Option<(&str, usize)> = None;
    for name in ORDER {
        let at = [format!("`{name}`"), format!("`{name}/`")]
            .iter()
            .filter_map(|written| list.find(written.as_str()))
            .min()
            .unwrap_or_else(|| panic!("{}: the list of modules does not name `{name}`", path.display()));
        if let Some((before, before_at)) = last {
            assert!(
                at > before_at,
                "{}: `{name}` is listed before `{before}`, but tests/it/module_imports.rs's ORDER has it after",
                path.display()
            );
        }
        last = Some((name, at));
    }
}
