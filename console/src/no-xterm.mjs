// Stands in for xterm.js and its fit add-on when the daemon was built
// without console/node_modules (see crates/hutch-server/build.rs): the
// console works, and its terminal says what is missing.
export const Terminal = null;
export const FitAddon = null;
