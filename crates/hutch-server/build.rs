//! Puts the web console's third-party modules in OUT_DIR for
//! `src/console.rs` to embed: xterm.js and its fit add-on, from
//! `console/node_modules` (`npm ci` in `console/`, which scripts/test.sh
//! runs before it builds). Without them the daemon still builds and its
//! console works, but its terminal says it was built without xterm: stubs
//! with the same exports stand in (`console/src/no-xterm.mjs`).

use std::path::{Path, PathBuf};

/// (file under node_modules, name in OUT_DIR, stand-in when absent).
const VENDORED: [(&str, &str, &str); 3] = [
    ("@xterm/xterm/lib/xterm.mjs", "xterm.mjs", "src/no-xterm.mjs"),
    ("@xterm/addon-fit/lib/addon-fit.mjs", "addon-fit.mjs", "src/no-xterm.mjs"),
    ("@xterm/xterm/css/xterm.css", "xterm.css", ""),
];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let console = manifest.join("../../console");
    // The whole package, node_modules included: `npm ci` reruns this.
    println!("cargo:rerun-if-changed={}", console.display());
    let modules = console.join("node_modules");
    let whole = VENDORED.iter().all(|(from, _, _)| modules.join(from).is_file());
    for (from, to, stand_in) in VENDORED {
        let bytes = if whole {
            read(&modules.join(from))
        } else if stand_in.is_empty() {
            Vec::new()
        } else {
            read(&console.join(stand_in))
        };
        std::fs::write(out.join(to), bytes).unwrap_or_else(|e| panic!("writing {to} in OUT_DIR: {e}"));
    }
    if !whole {
        println!(
            "cargo:warning=console/node_modules has no xterm: the web console's terminal is built without it \
             (run `npm ci` in console/, then build again)"
        );
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}
