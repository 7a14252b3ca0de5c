//! Bytes on the agent socket: the length-prefixed frame, the request the
//! agent decodes from it, and the response flatnet-cni decodes. Properties:
//! a decoded request re-encodes to the same request, and its admission
//! check answers without panicking; a decoded response round-trips; a
//! written frame reads back as its body.
#![no_main]

use std::io::Cursor;

use flatnet_agent::rpc::{
    AgentRequest, AgentResponse,
    frame::{read_frame, write_frame},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(body) = read_frame(&mut Cursor::new(data)) else {
        return;
    };
    let mut framed = Vec::new();
    write_frame(&mut framed, &body).expect("a body that was read can be written");
    assert_eq!(
        read_frame(&mut Cursor::new(&framed)).ok(),
        Some(body.clone())
    );

    if let Ok(request) = AgentRequest::decode(&body) {
        let _ = request.request.admit();
        let wire = serde_json::to_vec(&request).expect("a request serialises");
        assert_eq!(AgentRequest::decode(&wire).ok(), Some(request));
    }
    if let Ok(response) = serde_json::from_slice::<AgentResponse>(&body) {
        let wire = serde_json::to_vec(&response).expect("a response serialises");
        let again: AgentResponse = serde_json::from_slice(&wire).expect("a response decodes");
        assert_eq!(again, response);
    }
});
