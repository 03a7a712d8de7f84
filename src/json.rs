//! Proto3 JSON of kvgate's messages, as grpcurl prints them and the fixtures
//! spell them: proto field names, 64-bit integers as decimal strings, enums
//! by name, bytes in base64, unset optionals absent.

use std::sync::LazyLock;

use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};

use crate::proto::FILE_DESCRIPTOR_SET;

static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(FILE_DESCRIPTOR_SET).expect("build.rs wrote a valid descriptor set")
});

/// How proto3 JSON spells field names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldNames {
    /// As in the `.proto` file (`block_hash`): the fixtures' spelling.
    Proto,
    /// lowerCamelCase (`blockHash`): the JSON mapping's default, as grpcurl
    /// prints it.
    Json,
}

/// `message` (whose proto name is `full_name`, e.g.
/// `smg.grpc.common.KvCacheEvent`) as proto3 JSON with proto field names.
pub fn to_json(message: &impl prost::Message, full_name: &str) -> serde_json::Value {
    to_json_with(message, full_name, FieldNames::Proto)
}

/// `message` as proto3 JSON with field names spelled as `names` says.
pub fn to_json_with(
    message: &impl prost::Message,
    full_name: &str,
    names: FieldNames,
) -> serde_json::Value {
    let descriptor = POOL
        .get_message_by_name(full_name)
        .unwrap_or_else(|| panic!("{full_name} is not one of kvgate's messages"));
    let dynamic = DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())
        .expect("a message decodes as its own type");
    let options = SerializeOptions::new().use_proto_field_name(names == FieldNames::Proto);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .expect("proto3 JSON always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{
        KvBlock, KvBlocksStored, KvCacheEvent, KvCacheTier, kv_cache_event::Data,
    };

    #[test]
    fn events_print_as_proto3_json_with_proto_field_names() {
        let event = KvCacheEvent {
            event_id: 7,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: vec![KvBlock {
                    block_hash: -5,
                    token_ids: vec![1, 2],
                    block_size: 2,
                    ..Default::default()
                }],
                tier: Some(KvCacheTier::Device as i32),
                group_idx: Some(0),
                ..Default::default()
            })),
        };
        let json = to_json(&event, "smg.grpc.common.KvCacheEvent");
        assert_eq!(
            json,
            serde_json::json!({
                "event_id": "7",
                "stored": {
                    "blocks": [{"block_hash": "-5", "token_ids": [1, 2], "block_size": 2}],
                    "tier": "KV_CACHE_TIER_DEVICE",
                    "group_idx": 0
                }
            })
        );
    }
}
