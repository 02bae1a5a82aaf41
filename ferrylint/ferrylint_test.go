package ferrylint_test

import (
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/ferry-dev/ferry/ferrylint"
)

func TestAnalyzer(t *testing.T) {
	analysistest.Run(t, analysistest.TestData(), ferrylint.Analyzer, "helper", "a")
}
