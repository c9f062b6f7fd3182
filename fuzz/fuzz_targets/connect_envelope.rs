//! Connect envelopes of the E2B API (hutch-server's e2b connect): the one
//! message of a server-stream request, and the client stream of
//! `StreamInput` as its chunks arrive. A message parses the same in an
//! envelope of its own, whatever followed it, and a stream split anywhere yields the same messages, the
//! same rest and the same verdict as the stream whole.
#![no_main]

use hutch_server::fuzz_api::{connect_stream_request, connect_take_messages};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = connect_stream_request(data) {
        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
        assert!(data.len() >= 5 + len);
        // The same message alone, in an envelope of its own, is the same.
        let mut again = vec![0u8];
        again.extend_from_slice(&data[1..5 + len]);
        assert_eq!(connect_stream_request(&again), Ok(v));
    }

    let mut whole = data.to_vec();
    let all = connect_take_messages(&mut whole);
    let cut = data.first().map_or(0, |b| *b as usize * 7) % (data.len() + 1);
    let mut buf = data[..cut].to_vec();
    let first = connect_take_messages(&mut buf);
    match (all, first) {
        (Ok(all), Ok(mut got)) => {
            buf.extend_from_slice(&data[cut..]);
            got.extend(connect_take_messages(&mut buf).expect("the rest parses as the whole did"));
            assert_eq!(got, all);
            assert_eq!(buf, whole, "the same incomplete message is left");
        }
        (Err(_), Ok(_)) => {
            buf.extend_from_slice(&data[cut..]);
            assert!(connect_take_messages(&mut buf).is_err(), "the whole failed, the pieces did not");
        }
        (Ok(_), Err(e)) => panic!("a prefix failed ({e}) where the whole stream parsed"),
        (Err(_), Err(_)) => {}
    }
    // What is left is one incomplete message at most: taking again takes nothing.
    if let Ok(none) = connect_take_messages(&mut whole.clone()) {
        assert!(none.is_empty());
    }
});
