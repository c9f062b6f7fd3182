//! Frames from an agent, as the host reads them (hutch-agent's proto, and
//! hutch-runtime's reader on a real socket): the length words, and the JSON
//! headers of every message type either side reads. The splitter keeps its
//! bounds, the host's reader yields exactly the frames the splitter does and
//! then an error (never a hang), and every message that parses encodes back
//! to itself.
#![no_main]

use hutch_agent::proto::{self, AgentConfig, FrameError, FromAgent, ToAgent};
use hutch_runtime::agent::{AgentConn, AgentError};
use libfuzzer_sys::fuzz_target;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

fuzz_target!(|data: &[u8]| {
    // The pure splitter, frame after frame, as a stream of them.
    let mut frames: Vec<(FromAgent, Vec<u8>)> = Vec::new();
    let mut rest = data;
    let end = loop {
        match proto::split_frame(rest) {
            Ok(Some(f)) => {
                assert!(f.consumed <= rest.len());
                assert_eq!(f.consumed, 8 + f.header.len() + f.data.len());
                assert!(f.header.len() <= proto::MAX_HEADER && f.data.len() <= proto::MAX_DATA);
                assert!(f.consumed - 4 <= proto::MAX_FRAME);
                let _ = proto::parse_header::<ToAgent>(f.header);
                let _ = proto::parse_header::<AgentConfig>(f.header);
                match proto::parse_header::<FromAgent>(f.header) {
                    Ok(msg) => {
                        round_trip(&msg, f.data);
                        frames.push((msg, f.data.to_vec()));
                    }
                    Err(e) => break Some(e),
                }
                rest = &rest[f.consumed..];
            }
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };

    // The host's reader over a socket whose other end wrote `data` and
    // closed: the same messages, then an error.
    if data.len() > 64 * 1024 {
        return; // more than a socket buffer holds without a reader
    }
    let (mut agent, host) = UnixStream::pair().expect("socketpair");
    agent.write_all(data).expect("write");
    drop(agent);
    let mut conn = AgentConn::from_stream(host);
    for (msg, bytes) in &frames {
        match conn.recv(Some(Duration::from_secs(10))) {
            Ok((got, got_bytes)) => {
                assert_eq!(&got, msg);
                assert_eq!(&got_bytes, bytes);
            }
            Err(e) => panic!("the reader failed ({e}) on a frame the splitter took"),
        }
    }
    match (conn.recv(Some(Duration::from_secs(10))), end) {
        (Err(AgentError::Closed), None) => {}
        (Err(AgentError::Protocol(got)), Some(want)) => {
            assert_eq!(std::mem::discriminant(&got), std::mem::discriminant(&want), "reader: {got}, splitter: {want}")
        }
        // The splitter checks the header's (and so the data's) length as
        // soon as it has it; the reader first waits for the whole frame,
        // which never comes.
        (Err(AgentError::Closed), Some(FrameError::BadHeaderLength(_) | FrameError::DataTooLarge(_))) => {}
        (got, want) => panic!("reader: {got:?}, splitter ended with {want:?}"),
    }
});

/// A message that parsed encodes to a frame that splits and parses to it.
fn round_trip(msg: &FromAgent, data: &[u8]) {
    let mut out = Vec::new();
    match proto::encode(msg, data, &mut out) {
        Ok(()) => {
            let f = proto::split_frame(&out).expect("an encoded frame splits").expect("and is complete");
            assert_eq!(f.consumed, out.len());
            assert_eq!(&proto::parse_header::<FromAgent>(f.header).expect("an encoded header parses"), msg);
            assert_eq!(f.data, data);
        }
        Err(FrameError::DataTooLarge(n)) => assert!(n > proto::MAX_DATA),
        // Defaults written out can grow a header that was at the limit.
        Err(FrameError::BadHeaderLength(n)) => assert!(n as usize > proto::MAX_HEADER),
        Err(e) => panic!("a parsed message does not encode: {e}"),
    }
}
