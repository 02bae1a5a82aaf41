package pipelinetest

import (
	"strings"
	"sync"
)

// SyncBuffer collects what a process or a component writes (its log, its
// output) while the test reads it: safe for one writer and any readers at
// once, which a strings.Builder or bytes.Buffer is not.
type SyncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
