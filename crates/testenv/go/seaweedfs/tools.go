//go:build tools

// Package tools pins SeaweedFS, whose S3 gateway is the object storage the PostgreSQL backup
// tests of crates/testenv write to (Apache-2.0; a real S3 server, not a mock).
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
