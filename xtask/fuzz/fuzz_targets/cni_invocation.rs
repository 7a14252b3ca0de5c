//! The CNI environment and stdin as flatnet-cni reads them (ADD, DEL, CHECK,
//! GC, STATUS, VERSION). Properties: every refusal carries a spec or flatnet
//! error code; the agent admits every request flatnet-cni accepted; an
//! accepted configuration re-serialises to the same configuration; the
//! request crosses the agent socket unchanged.
#![no_main]

use flatnet_agent::{
    cni::{CniEnv, ErrorCode, Invocation, NetworkConfig, request::Admission},
    rpc::{AgentRequest, PROTOCOL_VERSION},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (vars, stdin) = flatnet_fuzz::env_and_stdin(data);
    let env = match CniEnv::from_lookup(|name| vars.get(name).cloned()) {
        Ok(env) => env,
        Err(error) => {
            assert_eq!(error.code, ErrorCode::InvalidEnvironment, "{error}");
            return;
        }
    };
    let request = match Invocation::parse(&env, stdin) {
        Ok(Invocation::Request(request)) => request,
        Ok(Invocation::Version { .. } | Invocation::NothingToDelete(_)) => return,
        Err(error) => {
            assert!(
                !matches!(error.code, ErrorCode::Other(_)),
                "an unnamed error code: {error}"
            );
            return;
        }
    };
    assert_eq!(
        request
            .admit()
            .expect("the agent admits what flatnet-cni sends"),
        Admission::Serve
    );
    let config = request.config();
    let text = serde_json::to_vec(config).expect("a configuration serialises");
    let again = NetworkConfig::decode(&text).expect("a re-serialised configuration decodes");
    assert_eq!(&again, config);
    let wire = serde_json::to_vec(&AgentRequest {
        protocol: PROTOCOL_VERSION,
        timeout_ms: 1000,
        request: (*request).clone(),
    })
    .expect("a request serialises");
    let received = AgentRequest::decode(&wire).expect("the agent decodes what flatnet-cni sends");
    assert_eq!(received.request, *request);
});
