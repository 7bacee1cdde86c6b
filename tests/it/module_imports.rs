//! The modules are layered (see the crate docs in src/lib.rs), and the
//! folders of src/ are the layers: every `crate::` path in a module names
//! a layer below its own, or a module before it in its own layer. This reads
//! src/ and fails on a path that runs back up, on a module or layer that is
//! not in the order below, and on a `mod` list (src/lib.rs, a layer's
//! mod.rs) in another order.

use std::fs;
use std::path::{Path, PathBuf};

/// The layers, lowest first, each with its modules, lowest first. A layer
/// is a folder of src/ (`src/base/`) whose modules are its files and
/// folders (`src/base/checksum.rs`, `src/engines/cuda/`); a layer without a
/// list is one module (`src/plan.rs`, or `src/verify/`, whose own modules
/// `no_module_import_cycle` keeps apart). A module may use the layers
/// before its own and the modules before it in its layer.
const ORDER: &[(&str, &[&str])] = &[
    // arithmetic and plumbing: errors, the checksum arithmetic, the stored
    // entry's bytes, msgpack, transfer topology
    ("base", &["error", "checksum", "stored_entry", "msgpack", "topology"]),
    // layer decodings, token placements, state layers, the worker's role, layouts, block
    // sets, fingerprints, the caller's stream
    (
        "inputs",
        &[
            "decoding",
            "placement",
            "state",
            "role",
            "layout",
            "layout_string",
            "blocks",
            "fingerprint",
            "stream",
        ],
    ),
    // the worker facts a record carries, a call's checksums
    ("results", &["record_facts", "checksums"]),
    // the plan of a call
    ("plan", &[]),
    // the host engine (with its thread pool), the device engine, detail
    // mode, stored checksums
    ("engines", &["host", "cuda", "detail", "stored"]),
    // the worker
    ("worker", &[]),
    // the values of a worker's full blocks by block hash
    ("tier_index", &[]),
    // records and payloads
    ("wire", &["record", "payload"]),
    // the verifier
    ("verify", &[]),
    // the repair plan of a verifier's report
    ("repair", &[]),
    // the C boundary
    ("ffi", &[]),
];

/// Where a module sits: its layer's place in `ORDER` and, in a layer of
/// several modules, its place in the layer's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    layer: usize,
    module: Option<usize>,
}

/// The place of the module that a path's first segments name (`["base",
/// "checksum", ...]`), or why it has none.
fn rank(path: &[String]) -> Result<Rank, String> {
    let Some(first) = path.first() else {
        return Err("an empty path".to_owned());
    };
    let layer = ORDER
        .iter()
        .position(|(name, _)| name == first)
        .ok_or_else(|| format!("`{first}` is not a layer in ORDER"))?;
    let modules = ORDER[layer].1;
    if modules.is_empty() {
        return Ok(Rank { layer, module: None });
    }
    let Some(second) = path.get(1) else {
        return Ok(Rank { layer, module: None });
    };
    let module = modules
        .iter()
        .position(|name| name == second)
        .ok_or_else(|| format!("`{first}::{second}` is not a module of layer `{first}` in ORDER"))?;
    Ok(Rank {
        layer,
        module: Some(module),
    })
}

/// The module a file under src/ belongs to, as its layer and (in a layer
/// of several modules) the module in it: `["base", "checksum"]` for
/// src/base/checksum.rs, `["engines", "cuda"]` for src/engines/cuda/launch.rs,
/// `["base"]` for src/base/mod.rs, `["plan"]` for src/plan.rs and
/// `["verify"]` for src/verify/check.rs; empty for lib.rs.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_str().unwrap().to_owned())
        .collect();
    if parts == ["lib"] {
        return Vec::new();
    }
    let layered = ORDER
        .iter()
        .any(|(name, modules)| *name == parts[0] && !modules.is_empty());
    let depth = if layered { 2 } else { 1 };
    parts.into_iter().take(depth).filter(|part| part != "mod").collect()
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

/// The paths a line names through `crate::` or `$crate::`, each cut to its
/// first two segments (the layer and the module in it; `crate::{a, b::c}`
/// and use-trees included); comments are skipped.
fn referenced(line: &str) -> Vec<Vec<String>> {
    let code = line.split("//").next().unwrap();
    let mut paths: Vec<Vec<String>> = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `kvcrate::`, not a crate path
        }
        for mut path in use_tree(rest).0 {
            path.truncate(2);
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
    }
    paths
}

#[test]
fn imports_run_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    let mut modules_seen = 0;
    for file in &files {
        let module = module_of(&src, file);
        if module.is_empty() {
            continue;
        }
        modules_seen += 1;
        let own = match rank(&module) {
            Ok(own) => own,
            Err(why) => {
                problems.push(format!(
                    "{}: {why}; add it at its layer in tests/it/module_imports.rs's ORDER",
                    file.display()
                ));
                continue;
            }
        };
        let text = fs::read_to_string(file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for path in referenced(line) {
                // Crate-root re-exports (`crate::Result`) name no module.
                if path[0].chars().next().is_some_and(|c| c.is_uppercase()) {
                    continue;
                }
                let target = match rank(&path) {
                    Ok(target) => target,
                    Err(why) => {
                        problems.push(format!(
                            "{}:{}: `crate::{}`: {why}",
                            file.display(),
                            number + 1,
                            path.join("::")
                        ));
                        continue;
                    }
                };
                let up = target.layer > own.layer
                    || (target.layer == own.layer && own.module.is_some() && target.module > own.module)
                    || (target.layer == own.layer && own.module.is_none() && target.module.is_some());
                if up {
                    problems.push(format!(
                        "{}:{}: `{}` uses `{}`, which is above it in the layering: {}",
                        file.display(),
                        number + 1,
                        module.join("::"),
                        path.join("::"),
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

/// The `mod` declarations of a file, in order.
fn declared_modules(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let declared = line.trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            declared.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

/// src/lib.rs declares the layers in ORDER, and each layer's mod.rs its
/// modules in ORDER, so that reading either shows the layering.
#[test]
fn lib_and_each_layer_declare_their_modules_in_layer_order() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    let layers: Vec<&str> = ORDER.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        declared_modules(&lib),
        layers,
        "src/lib.rs's `mod` list is not ORDER's layers"
    );
    for (layer, modules) in ORDER.iter().filter(|(_, modules)| !modules.is_empty()) {
        let text = fs::read_to_string(src.join(layer).join("mod.rs")).unwrap();
        assert_eq!(
            declared_modules(&text),
            *modules,
            "src/{layer}/mod.rs's `mod` list is not ORDER's modules of `{layer}`"
        );
    }
}

/// Crate-root paths (`crate::Result`) are re-exports of lower modules, but
/// hide which one; the engine names the module instead.
#[test]
fn no_module_uses_root_reexports_of_higher_layers() {
    // `crate::Result` is the only root path in use, and `base::error` is the bottom module.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for path in referenced(line) {
                let name = &path[0];
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
    let paths = |line| {
        referenced(line)
            .into_iter()
            .map(|path| path.join("::"))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        paths("use crate::inputs::layout::{Layout, Segment};"),
        ["inputs::layout"]
    );
    assert_eq!(
        paths("use crate::{inputs::blocks::BlockSet, plan::{Plan, Row}};"),
        ["inputs::blocks", "plan::Plan", "plan::Row"]
    );
    assert_eq!(
        paths("    $crate::ffi::status::fail(&$crate::base::error::Error::X)"),
        ["ffi::status", "base::error"]
    );
    assert_eq!(paths("// use crate::worker::Worker;"), Vec::<String>::new());
    assert_eq!(
        paths("let x = crate::wire::record::Record::decode(b)?;"),
        ["wire::record"]
    );
    assert_eq!(paths("crate::Result<()>"), ["Result"]);
    let src = Path::new("/r/src");
    assert_eq!(
        module_of(src, Path::new("/r/src/base/checksum.rs")),
        ["base", "checksum"]
    );
    assert_eq!(
        module_of(src, Path::new("/r/src/engines/cuda/launch.rs")),
        ["engines", "cuda"]
    );
    assert_eq!(
        module_of(src, Path::new("/r/src/engines/host/mod.rs")),
        ["engines", "host"]
    );
    assert_eq!(module_of(src, Path::new("/r/src/base/mod.rs")), ["base"]);
    assert_eq!(module_of(src, Path::new("/r/src/verify/check.rs")), ["verify"]);
    assert_eq!(module_of(src, Path::new("/r/src/plan.rs")), ["plan"]);
    assert!(module_of(src, Path::new("/r/src/lib.rs")).is_empty());
    // A path within a layer ranks by the module; a plain layer by itself.
    let rank_of = |path: &str| rank(&path.split("::").map(str::to_owned).collect::<Vec<_>>());
    assert!(rank_of("base::error").unwrap() < rank_of("base::checksum").unwrap());
    assert!(rank_of("base::topology").unwrap() < rank_of("inputs::decoding").unwrap());
    assert!(rank_of("plan::Plan").unwrap() < rank_of("engines::host").unwrap());
    assert!(rank_of("base::nothing").is_err());
    assert!(rank_of("nowhere").is_err());
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

/// The module a file under src/ is (`["engines", "cuda", "buffers"]` for
/// src/engines/cuda/buffers.rs, `["engines", "cuda"]` for
/// src/engines/cuda/mod.rs, empty for lib.rs).
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
/// (src/engines/cuda/, src/verify/, src/ffi/, and the layers) included, the folder's mod.rs being
/// a module of its own.
#[test]
fn no_module_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(
        graph.contains_key("engines::cuda::buffers") && graph["engines::cuda"].contains("engines::cuda::buffers"),
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
    // A module path in src/engines/cuda/buffers.rs: super is cuda.
    let src = Path::new("/r/src");
    assert_eq!(
        module_path(src, Path::new("/r/src/engines/cuda/buffers.rs")),
        ["engines", "cuda", "buffers"]
    );
    assert_eq!(
        module_path(src, Path::new("/r/src/engines/cuda/mod.rs")),
        ["engines", "cuda"]
    );
    assert!(module_path(src, Path::new("/r/src/lib.rs")).is_empty());
}

/// docs/ARCHITECTURE.md's numbered list is the one description of the
/// layers and modules: it names every layer of `ORDER` and every module in
/// it, in that order, so a module added at a layer cannot go undocumented
/// or documented at another.
#[test]
fn the_architecture_page_lists_the_modules_in_layer_order() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md");
    let page = fs::read_to_string(&path).unwrap();
    let modules = page.split("\n## Modules\n").nth(1).expect("a section `## Modules`");
    let modules = modules.split("\n## ").next().unwrap();
    let list = &modules[modules.find("\n1. ").expect("a numbered list of the layers")..];
    let mut last: Option<(String, usize)> = None;
    let names = ORDER.iter().flat_map(|(layer, modules)| {
        std::iter::once((layer.to_string(), layer.to_string())).chain(
            modules
                .iter()
                .map(move |module| (format!("{layer}::{module}"), module.to_string())),
        )
    });
    for (name, written) in names {
        // A layer or module is named as `name` or, if a folder, `name/`.
        let at = [format!("`{written}`"), format!("`{written}/`")]
            .iter()
            .filter_map(|form| list.find(form.as_str()))
            .min()
            .unwrap_or_else(|| panic!("{}: the list of modules does not name `{name}`", path.display()));
        if let Some((before, before_at)) = &last {
            assert!(
                at > *before_at,
                "{}: `{name}` is listed before `{before}`, but tests/it/module_imports.rs's ORDER has it after",
                path.display()
            );
        }
        last = Some((name, at));
    }
}
