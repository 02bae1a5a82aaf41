package pipeline_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
)

func TestSplitList(t *testing.T) {
	t.Parallel()
	require.Equal(t, []string{"a", "b c", "d"}, pipeline.SplitList(" a, ,b c,,d ,"))
	require.Empty(t, pipeline.SplitList(" , "))
}
